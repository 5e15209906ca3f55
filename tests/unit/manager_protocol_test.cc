// The manager's wire format: round trips, and every kind of malformed message is a
// ProtocolError that names what is wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "manager/protocol.h"
#include "memory/channel_registry.h"
#include "shmtensor/error.h"

namespace shmtensor::internal::manager {
namespace {

std::string header_bytes(MessageType type, std::uint64_t a = 0, std::uint64_t b = 0) {
  MessageHeader h{};
  encode_header(type, a, b, &h);
  return std::string(reinterpret_cast<const char*>(&h), sizeof h);
}

void expect_rejected(const std::string& bytes, const std::string& words) {
  try {
    decode(bytes.data(), bytes.size());
    ADD_FAILURE() << "accepted a malformed message; expected: " << words;
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(ManagerProtocolTest, NamesRoundTrip) {
  Message m;
  m.type = MessageType::kRegisterCreated;
  m.names = {"/shmtensor_12_00ff_0", "/shmtensor_12_00ff_1"};
  std::string bytes = encode(m);
  Message back = decode(bytes.data(), bytes.size());
  EXPECT_EQ(back.type, MessageType::kRegisterCreated);
  EXPECT_EQ(back.names, m.names);
}

TEST(ManagerProtocolTest, HeaderOnlyMessagesRoundTrip) {
  std::string bytes = header_bytes(MessageType::kForkChild, 7, 4242);
  Message back = decode(bytes.data(), bytes.size());
  EXPECT_EQ(back.type, MessageType::kForkChild);
  EXPECT_EQ(back.a, 7u);
  EXPECT_EQ(back.b, 4242u);
  EXPECT_TRUE(back.names.empty());
}

TEST(ManagerProtocolTest, ReleaseCarriesOneNameAndAFlag) {
  Message m;
  m.type = MessageType::kRelease;
  m.a = 1;
  m.names = {"/shmtensor_1_a_2"};
  std::string bytes = encode(m);
  Message back = decode(bytes.data(), bytes.size());
  EXPECT_EQ(back.a, 1u);
  ASSERT_EQ(back.names.size(), 1u);
  m.a = 2;
  expect_rejected(encode(m), "unlinked flag");
  m.a = 0;
  m.names.push_back("/shmtensor_1_a_3");
  expect_rejected(encode(m), "a release names 2");
}

TEST(ManagerProtocolTest, LongNameListsAreSplitIntoMessagesThatFit) {
  std::vector<std::string> names;
  for (int i = 0; i < 1000; ++i)
    names.push_back("/shmtensor_99_0123456789abcdef_" + std::to_string(i));
  auto msgs = encode_names(MessageType::kRegisterHeld, names);
  EXPECT_GT(msgs.size(), 1u);
  std::vector<std::string> back;
  for (const auto& b : msgs) {
    EXPECT_LE(b.size(), kMaxMessageSize);
    Message m = decode(b.data(), b.size());
    back.insert(back.end(), m.names.begin(), m.names.end());
  }
  EXPECT_EQ(back, names);
}

TEST(ManagerProtocolTest, MalformedMessagesAreRejected) {
  expect_rejected("short", "shorter than the 24-byte header");
  std::string bad_magic = header_bytes(MessageType::kHello);
  bad_magic[0] ^= 1;
  expect_rejected(bad_magic, "bad magic");
  std::string bad_version = header_bytes(MessageType::kHello);
  reinterpret_cast<MessageHeader*>(bad_version.data())->version = 99;
  expect_rejected(bad_version, "protocol version 99");
  std::string bad_type = header_bytes(MessageType::kHello);
  reinterpret_cast<MessageHeader*>(bad_type.data())->type = 1000;
  expect_rejected(bad_type, "unknown type 1000");
  expect_rejected(header_bytes(MessageType::kRegisterCreated), "name list is empty");
  expect_rejected(header_bytes(MessageType::kRegisterCreated) + "/shmtensor_1_a_0",
                  "not NUL-terminated");
  expect_rejected(header_bytes(MessageType::kHello) + "x", "unexpected payload");
  expect_rejected(header_bytes(MessageType::kForkChild, 1, 0), "fork child pid 0");
  expect_rejected(std::string(kMaxMessageSize + 1, 'x'), "over the limit");
}

TEST(ManagerProtocolTest, OnlyShmtensorNamesOfSafeCharactersAreAccepted) {
  EXPECT_TRUE(is_valid_segment_name("/shmtensor_1_ab_0"));
  EXPECT_FALSE(is_valid_segment_name("/shmtensor_"));
  EXPECT_FALSE(is_valid_segment_name("/torch_1_2"));
  EXPECT_FALSE(is_valid_segment_name("shmtensor_1"));
  EXPECT_FALSE(is_valid_segment_name("/shmtensor_../../etc/passwd"));
  EXPECT_FALSE(is_valid_segment_name("/shmtensor_a/b"));
  EXPECT_FALSE(is_valid_segment_name("/shmtensor_a b"));
  EXPECT_FALSE(is_valid_segment_name("/shmtensor_" + std::string(kMaxNameLength, 'a')));
  for (const char* name : {"/shmtensor_../x", "/torch_1"}) {
    expect_rejected(header_bytes(MessageType::kRegisterOpened) + name + std::string(1, '\0'),
                    "invalid segment name");
  }
}

}  // namespace
}  // namespace shmtensor::internal::manager

namespace shmtensor::internal::manager {
namespace {

TEST(ManagerProtocolTest, ChannelMessagesRoundTrip) {
  Message m{MessageType::kPublishChannel, 1, 0xabcdef, {}, {}, "train.batches-0", {"\0x\1", 3}};
  std::string bytes = encode(m);
  Message back = decode(bytes.data(), bytes.size());
  EXPECT_EQ(back.type, MessageType::kPublishChannel);
  EXPECT_EQ(back.a, 1u);
  EXPECT_EQ(back.b, 0xabcdefu);
  EXPECT_EQ(back.channel, "train.batches-0");
  EXPECT_EQ(back.data, std::string("\0x\1", 3));
  Message entry{MessageType::kChannelEntry, 2, 4242, {}, {}, "q", "10 11"};
  bytes = encode(entry);
  back = decode(bytes.data(), bytes.size());
  EXPECT_EQ(back.channel, "q");
  EXPECT_EQ(back.data, "10 11");
  EXPECT_EQ(back.b, 4242u);
  Message reply{MessageType::kChannelReply, 2, 1, {}, {}, {}, "no channel named \"q\""};
  bytes = encode(reply);
  back = decode(bytes.data(), bytes.size());
  EXPECT_EQ(back.a, 2u);
  EXPECT_EQ(back.data, "no channel named \"q\"");
}

TEST(ManagerProtocolTest, MalformedChannelMessagesAreRejected) {
  const std::string open = header_bytes(MessageType::kOpenChannel, 1, 0);
  expect_rejected(open + "q", "channel name is not NUL-terminated");
  expect_rejected(open + std::string("\0", 1), "invalid channel name \"\"");
  expect_rejected(open + std::string("../x\0", 5), "invalid channel name \"../x\"");
  expect_rejected(open + std::string(".q\0", 3), "invalid channel name \".q\"");
  expect_rejected(open + std::string(kMaxChannelName + 1, 'a') + std::string("\0", 1),
                  "invalid channel name");
  expect_rejected(open + std::string("q\0x", 3), "unexpected bytes after a channel name");
  expect_rejected(header_bytes(MessageType::kOpenChannel, 1, 2) + std::string("q\0", 2),
                  "an open's flag is 2");
  expect_rejected(header_bytes(MessageType::kPublishChannel, 1, 0) + std::string("q\0", 2),
                  "a publish without a token");
  expect_rejected(header_bytes(MessageType::kListChannels) + "x", "unexpected payload");
  std::string bad_type = header_bytes(MessageType::kHello);
  reinterpret_cast<MessageHeader*>(bad_type.data())->type =
      static_cast<std::uint16_t>(kLastMessageType) + 1;
  expect_rejected(bad_type, "unknown type " + std::to_string(static_cast<int>(kLastMessageType) + 1));
  expect_rejected(header_bytes(MessageType::kKeepFd) + "short", "a token of 5 bytes, not 16");
  expect_rejected(header_bytes(MessageType::kKeptFd) + "x", "unexpected payload");
}

}  // namespace
}  // namespace shmtensor::internal::manager
