// Queues and connections across real forked processes, for both sharing strategies.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <set>
#include <thread>

#include "shmtensor/connection.h"
#include "shmtensor/internal/connection_access.h"
#include "shmtensor/queue.h"
#include "support/expect_error.h"
#include "support/leak_check.h"
#include "support/pipe.h"
#include "support/strategy_test.h"

namespace shmtensor {
namespace {

using testing::fork_child;
using testing::Pipe;
using testing::wait_child;

class TransportTest : public testing::StrategyTest {};

TEST_P(TransportTest, TensorSentOverPipeIsZeroCopyAndWritableBothWays) {
  auto [a, b] = pipe();
  pid_t child = fork_child([&, &b = b] {
    a.close();
    Tensor t = b.recv<Tensor>();
    EXPECT_TRUE(t.is_shared());
    EXPECT_EQ(t.data_ptr<float>()[3], 3.0f);
    t.data_ptr<float>()[0] = 42.0f;  // visible in the parent
    b.send(std::string("written"));
  });
  b.close();
  Tensor t = Tensor::arange(8, DType::kFloat32);
  EXPECT_FALSE(t.is_shared());
  a.send(t);
  EXPECT_TRUE(t.is_shared());  // moved into shared memory in place
  EXPECT_EQ(a.recv<std::string>(), "written");
  EXPECT_EQ(t.data_ptr<float>()[0], 42.0f);
  EXPECT_EQ(wait_child(child), 0);
}

// A Storage travels alone, with no view (Codec<Storage>: its storage index, wire_format.md):
// the same memory arrives, writable both ways; an undefined one arrives undefined and one
// of 0 bytes as a new empty one; a storage and a tensor over it in one message are one
// storage on arrival.
TEST_P(TransportTest, AStorageTravelsAloneAndWritesAreSeenBothWays) {
  auto [a, b] = pipe();
  pid_t child = fork_child([&, &b = b] {
    a.close();
    auto [s, empty, none, t] = b.recv<std::tuple<Storage, Storage, Storage, Tensor>>();
    EXPECT_TRUE(s.is_shared());
    ASSERT_EQ(s.nbytes(), 64u);
    EXPECT_EQ(static_cast<const std::uint8_t*>(s.data())[5], 5);
    static_cast<std::uint8_t*>(s.data())[0] = 200;  // visible in the parent
    EXPECT_TRUE(empty.defined());
    EXPECT_EQ(empty.nbytes(), 0u);
    EXPECT_FALSE(none.defined());
    EXPECT_EQ(t.storage().data(), s.data()) << "one storage, not two";
    b.send(std::string("written"));
  });
  b.close();
  Tensor t = Tensor::arange(64, DType::kUInt8);
  Storage s = t.storage();
  a.send(std::make_tuple(s, Storage::allocate(0), Storage(), t));
  EXPECT_TRUE(s.is_shared());
  EXPECT_EQ(a.recv<std::string>(), "written");
  EXPECT_EQ(static_cast<const std::uint8_t*>(s.data())[0], 200);
  EXPECT_EQ(wait_child(child), 0);
}

TEST_P(TransportTest, AStorageIndexOutsideTheMessagesTableIsAProtocolError) {
  auto [a, b] = pipe();
  Encoder e;
  e.write_pod<std::uint32_t>(3);  // a message with no storage table names storage 3
  internal::ConnectionAccess::send(a, std::move(e));
  EXPECT_ERROR((void)b.recv<Storage>(), ProtocolError, "storage index out of range");
}

TEST_P(TransportTest, IdentityIsPreservedWithinAMessageAndOnTheWayBack) {
  auto [a, b] = pipe();
  pid_t child = fork_child([&, &b = b] {
    a.close();
    auto [x, y, z] = b.recv<std::tuple<Tensor, Tensor, Tensor>>();
    // Views of one storage arrive as views of one storage.
    EXPECT_TRUE(x.storage().is_same(y.storage()));
    EXPECT_FALSE(x.storage().is_same(z.storage()));
    EXPECT_EQ(y.data_ptr<std::int64_t>()[0], 5);
    Tensor again = b.recv<Tensor>();
    EXPECT_TRUE(again.storage().is_same(x.storage()));  // sent twice: one storage
    b.send(std::make_pair(x, z));                        // back to the creator
  });
  b.close();
  Tensor base = Tensor::arange(10);
  Tensor other = Tensor::ones({3}, DType::kFloat64);
  a.send(std::make_tuple(base, base.slice(0, 5, 10), other));
  a.send(base);
  auto [back_base, back_other] = a.recv<std::pair<Tensor, Tensor>>();
  EXPECT_TRUE(back_base.storage().is_same(base.storage()));
  EXPECT_EQ(back_base.data_ptr<std::int64_t>(), base.data_ptr<std::int64_t>());
  EXPECT_TRUE(back_other.storage().is_same(other.storage()));
  EXPECT_EQ(wait_child(child), 0);
}

TEST_P(TransportTest, NonContiguousViewsTravelAsViewsAndEmptyTensorsNeedNoSharedMemory) {
  auto [a, b] = pipe();
  pid_t child = fork_child([&, &b = b] {
    a.close();
    auto v = b.recv<std::vector<Tensor>>();
    EXPECT_EQ(v.size(), 2u);
    EXPECT_FALSE(v[0].is_contiguous());
    EXPECT_EQ(v[0].sizes(), (std::vector<std::int64_t>{3, 2}));
    EXPECT_EQ(v[0].select(0, 0).select(0, 0).item<std::int32_t>(), 0);
    EXPECT_EQ(v[0].select(0, 2).select(0, 1).item<std::int32_t>(), 5);
    EXPECT_EQ(v[1].numel(), 0);
    EXPECT_EQ(v[1].sizes(), (std::vector<std::int64_t>{0, 4}));
    EXPECT_EQ(v[1].dtype(), DType::kFloat16);
  });
  b.close();
  Tensor m = Tensor::arange(6, DType::kInt32).view({2, 3}).transpose(0, 1);
  Tensor empty = Tensor::empty({0, 4}, DType::kFloat16);
  a.send(std::vector<Tensor>{m, empty});
  EXPECT_FALSE(empty.is_shared() && empty.storage().nbytes() > 0);
  EXPECT_EQ(wait_child(child), 0);
}

// Sizes and strides are kept inline up to 6 dims (dims.h) and on the heap beyond: both
// arrive exactly, as views of the sender's storage.
TEST_P(TransportTest, TensorsOfSixAndOfNineDimensionsArriveWithTheirExactShape) {
  auto [a, b] = pipe();
  Tensor six = Tensor::arange(64, DType::kInt16).view({2, 2, 2, 2, 2, 2}).transpose(0, 5);
  Tensor nine =
      Tensor::arange(2 * 3 * 1 * 2 * 2 * 1 * 2 * 2 * 2).view({2, 3, 1, 2, 2, 1, 2, 2, 2});
  Tensor nine_view = nine.permute({8, 7, 6, 5, 4, 3, 2, 1, 0}).slice(1, 1);
  pid_t child = fork_child([&, &b = b] {
    a.close();
    auto [s, n] = b.recv<std::pair<Tensor, Tensor>>();
    EXPECT_EQ(s.sizes(), six.sizes());
    EXPECT_EQ(s.strides(), (std::vector<std::int64_t>{1, 16, 8, 4, 2, 32}));
    EXPECT_TRUE(s.equal(six));
    EXPECT_EQ(n.sizes(), (std::vector<std::int64_t>{2, 1, 2, 1, 2, 2, 1, 3, 2}));
    EXPECT_EQ(n.strides(), nine_view.strides());
    EXPECT_EQ(n.storage_offset(), 2);
    EXPECT_TRUE(n.equal(nine_view));
    b.send(n);  // back to its creator: the same storage and shape
  });
  b.close();
  a.send(std::make_pair(six, nine_view));
  Tensor back = a.recv<Tensor>();
  EXPECT_TRUE(back.storage().is_same(nine.storage()));
  EXPECT_EQ(back.sizes(), nine_view.sizes());
  EXPECT_EQ(back.strides(), nine_view.strides());
  EXPECT_EQ(wait_child(child), 0);
}

TEST_P(TransportTest, EveryDTypeRoundTrips) {
  auto [a, b] = pipe();
  pid_t child = fork_child([&, &b = b] {
    a.close();
    for (int i = 0; i < kNumDTypes; ++i) {
      Tensor t = b.recv<Tensor>();
      EXPECT_EQ(static_cast<int>(t.dtype()), i);
      Tensor expect = Tensor::arange(5, static_cast<DType>(i));
      EXPECT_TRUE(t.equal(expect)) << to_string(static_cast<DType>(i));
    }
  });
  b.close();
  for (int i = 0; i < kNumDTypes; ++i) a.send(Tensor::arange(5, static_cast<DType>(i)));
  EXPECT_EQ(wait_child(child), 0);
}

struct Sample {
  Tensor image;
  std::int64_t label = 0;
  std::string path;
  std::optional<std::map<std::string, double>> meta;
  std::variant<int, std::string> tag;
  SHMTENSOR_FIELDS(image, label, path, meta, tag)
};

TEST_P(TransportTest, PlainDataAndOptInStructs) {
  auto [a, b] = pipe();
  pid_t child = fork_child([&, &b = b] {
    a.close();
    auto s = b.recv<Sample>();
    EXPECT_EQ(s.label, 7);
    EXPECT_EQ(s.path, "/data/cat.png");
    ASSERT_TRUE(s.meta.has_value());
    EXPECT_EQ(s.meta->at("scale"), 0.5);
    EXPECT_EQ(std::get<std::string>(s.tag), "train");
    EXPECT_TRUE(s.image.equal(Tensor::zeros({2, 2})));
  });
  b.close();
  Sample s;
  s.image = Tensor::zeros({2, 2});
  s.label = 7;
  s.path = "/data/cat.png";
  s.meta = std::map<std::string, double>{{"scale", 0.5}};
  s.tag = std::string("train");
  a.send(s);
  EXPECT_EQ(wait_child(child), 0);
}

TEST_P(TransportTest, LargePlainPayloadTravelsInABlob) {
  auto [a, b] = pipe();
  std::vector<double> big(100000);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<double>(i) * 0.5;
  pid_t child = fork_child([&, &b = b] {
    a.close();
    auto v = b.recv<std::vector<double>>();
    EXPECT_EQ(v, big);
  });
  b.close();
  a.send(big);
  EXPECT_EQ(wait_child(child), 0);
}

TEST_P(TransportTest, SenderMayExitRightAfterPut) {
  Queue<Tensor> q;
  pid_t child = fork_child([&] {
    for (int i = 0; i < 50; ++i) q.put(Tensor::full({16}, i, DType::kInt32));
  });
  EXPECT_EQ(wait_child(child), 0);  // the producer is gone before anything is received
  for (int i = 0; i < 50; ++i) {
    Tensor t = q.get();
    EXPECT_EQ(t.data_ptr<std::int32_t>()[15], i);
  }
}

// Items whose frame is just under, at and over the 64 KiB a datagram carries inline (a
// frame is a 32-byte header, then the vector's 8-byte count and bytes): a queue's datagram
// adds its marker's position to the frame, and must still be received whole.
TEST_P(TransportTest, ItemsAroundTheInlineFrameLimitArriveWhole) {
  Queue<std::vector<std::uint8_t>> q;
  const std::size_t sizes[] = {65480, 65495, 65496, 65497, 70000};
  pid_t child = fork_child([&] {
    for (std::size_t n : sizes) {
      std::vector<std::uint8_t> v(n);
      for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(i * 7 + n);
      q.put(v);
    }
  });
  for (std::size_t n : sizes) {
    const std::vector<std::uint8_t> v = q.get();
    ASSERT_EQ(v.size(), n);
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(v[i], static_cast<std::uint8_t>(i * 7 + n)) << "size " << n << ", byte " << i;
  }
  EXPECT_EQ(wait_child(child), 0);
}

TEST_P(TransportTest, ManyProducersManyConsumersEveryItemExactlyOnce) {
  constexpr int kProducers = 3, kConsumers = 3, kPerProducer = 300;
  Queue<std::pair<int, Tensor>> q(16);
  Queue<std::vector<int>> results;
  std::vector<pid_t> pids;
  for (int p = 0; p < kProducers; ++p)
    pids.push_back(fork_child([&, p] {
      for (int i = 0; i < kPerProducer; ++i) {
        int id = p * kPerProducer + i;
        q.put({id, Tensor::full({4}, id, DType::kInt64)});
      }
    }));
  for (int c = 0; c < kConsumers; ++c)
    pids.push_back(fork_child([&] {
      std::vector<int> got;
      for (;;) {
        auto [id, t] = q.get();
        if (id < 0) break;
        EXPECT_EQ(t.data_ptr<std::int64_t>()[3], id);
        got.push_back(id);
      }
      results.put(got);
    }));
  for (int p = 0; p < kProducers; ++p) EXPECT_EQ(wait_child(pids[p]), 0);
  for (int c = 0; c < kConsumers; ++c) q.put({-1, Tensor()});
  std::vector<int> all;
  for (int c = 0; c < kConsumers; ++c) {
    auto got = results.get();
    all.insert(all.end(), got.begin(), got.end());
  }
  for (int c = 0; c < kConsumers; ++c) EXPECT_EQ(wait_child(pids[kProducers + c]), 0);
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), static_cast<std::size_t>(kProducers * kPerProducer));
  for (int i = 0; i < kProducers * kPerProducer; ++i) EXPECT_EQ(all[i], i);
}

TEST_P(TransportTest, MaxsizeBlocksAndTimeoutsExpire) {
  Queue<int> q(2);
  EXPECT_TRUE(q.try_put(1));
  EXPECT_TRUE(q.try_put(2));
  EXPECT_FALSE(q.try_put(3, std::chrono::milliseconds(50)));
  EXPECT_EQ(q.size(), 2u);
  pid_t child = fork_child([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(q.get(), 1);
  });
  q.put(3);  // blocks until the child took one
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_EQ(q.get(), 2);
  EXPECT_EQ(q.get(), 3);
  EXPECT_FALSE(q.try_get(std::chrono::milliseconds(30)).has_value());
}

TEST_P(TransportTest, AMaxsizeAboveTwoToThe31IsAProgrammerError) {
  // A violated precondition: std::invalid_argument, deliberately not a shmtensor::Error.
  try {
    Queue<int> q(std::size_t{1} << 31);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("maxsize 2147483648 is larger than"), std::string::npos)
        << e.what();
  }
  Queue<int> largest(0x7fffffff);
  EXPECT_EQ(largest.maxsize(), 0x7fffffffu);
}

TEST_P(TransportTest, CloseDrainsThenThrowsQueueClosed) {
  Queue<int> q;
  q.put(1);
  q.put(2);
  pid_t child = fork_child([&] {
    EXPECT_EQ(q.get(), 1);
    EXPECT_EQ(q.get(), 2);
    EXPECT_ERROR(q.get(), QueueClosed,
                 "get() on a closed and empty queue");  // woken by close() in the parent
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  q.close();
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_ERROR(q.put(3), QueueClosed, "put() on a closed queue");
}

// Whether the queue's readiness fd polls readable, waiting up to `ms`.
bool readable(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  const int n = ::poll(&p, 1, ms);
  return n == 1 && (p.revents & POLLIN) != 0;
}

// The readiness fd (what multiprocessing.Pool waits on): readable while items are there,
// whichever process put them and whichever path they took (a tensor with fds as a datagram
// and a marker, an item without fds in a ring slot), cleared by the get that empties the
// queue, and readable for good once the queue is closed.
TEST_P(TransportTest, ReadinessFdIsReadableWhileItemsAreThere) {
  Queue<Tensor> q;
  // Items put before anyone asked for the fd make it readable when it is asked for.
  pid_t early = fork_child([&] { q.put(Tensor::full({4}, 7, DType::kInt32)); });
  EXPECT_EQ(wait_child(early), 0);
  const int fd = q.readiness_fd();
  EXPECT_EQ(q.readiness_fd(), fd);
  EXPECT_TRUE(readable(fd, 0));
  EXPECT_EQ(q.get().data_ptr<std::int32_t>()[3], 7);
  EXPECT_FALSE(readable(fd, 0));

  // A producer in another process, while this one waits in poll: a tensor (fds), an empty
  // tensor (no shared memory, so no fds), then close.
  Pipe go;
  pid_t producer = fork_child([&] {
    EXPECT_EQ(go.receive(), 'x');
    q.put(Tensor::full({4}, 8, DType::kInt32));
    q.put(Tensor::empty({0}, DType::kFloat32));
    EXPECT_EQ(go.receive(), 'x');
    q.close();
  });
  go.send();
  EXPECT_TRUE(readable(fd, 10000));
  EXPECT_EQ(q.get().data_ptr<std::int32_t>()[0], 8);
  EXPECT_TRUE(readable(fd, 10000));  // the second item is there or on its way
  EXPECT_EQ(q.get().numel(), 0);
  EXPECT_FALSE(readable(fd, 0));
  go.send();
  EXPECT_TRUE(readable(fd, 10000));
  EXPECT_EQ(wait_child(producer), 0);
  EXPECT_ERROR(q.get(), QueueClosed, "get() on a closed and empty queue");
  EXPECT_TRUE(readable(fd, 0));  // closed: stays readable
}

TEST_P(TransportTest, TrySendRefusesWithoutBlockingWhenThePeerIsNotReading) {
  auto [a, b] = pipe();
  std::int64_t sent = 0;
  while (a.try_send(sent)) {
    ++sent;
    ASSERT_LT(sent, 1'000'000) << "the socket buffer never filled";
  }
  ASSERT_GT(sent, 0);
  EXPECT_EQ(b.recv<std::int64_t>(), 0);  // whole messages, in order; the refused one is not there
  EXPECT_TRUE(a.try_send(sent));
  for (std::int64_t i = 1; i <= sent; ++i) ASSERT_EQ(b.recv<std::int64_t>(), i);
  EXPECT_FALSE(b.poll());
  b.close();
  EXPECT_ERROR((void)a.try_send(std::int64_t{0}), ConnectionClosed,
               "send() on a connection whose peer has closed");
}

TEST_P(TransportTest, ARefusedPutMovesNothingIntoSharedMemory) {
  // Admission (closed? room?) is decided before a tensor is moved into shared memory.
  Tensor t = Tensor::arange(1000, DType::kFloat32);
  Queue<Tensor> full(1);
  full.put(Tensor::zeros({4}));
  EXPECT_FALSE(full.try_put(t));
  EXPECT_FALSE(full.try_put(t, std::chrono::milliseconds(20)));
  EXPECT_FALSE(t.is_shared());
  Queue<Tensor> closed;
  closed.close();
  EXPECT_ERROR(closed.put(t), QueueClosed, "put() on a closed queue");
  EXPECT_ERROR((void)closed.try_put(t), QueueClosed, "put() on a closed queue");
  EXPECT_FALSE(t.is_shared());
  // Admitted, it moves (in place) and arrives.
  EXPECT_EQ(full.get().numel(), 4);
  EXPECT_TRUE(full.try_put(t));
  EXPECT_TRUE(t.is_shared());
  Tensor got = full.get();
  EXPECT_EQ(got.data_ptr<float>(), t.data_ptr<float>());
}

TEST_P(TransportTest, TryPutWaitsForRoomInAFullSocketUntilItsDeadline) {
  Queue<std::string> q;  // unbounded: only the socket's buffer limits it
  const std::string item(4096, 'x');
  int queued = 0;
  while (q.try_put(item)) ++queued;
  ASSERT_GT(queued, 0);
  EXPECT_FALSE(q.try_put(item, std::chrono::milliseconds(20)));
  pid_t consumer = fork_child([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (int i = 0; i <= queued; ++i) EXPECT_EQ(q.get(), item);
  });
  EXPECT_TRUE(q.try_put(item, std::chrono::seconds(60)));  // room comes as the child gets
  EXPECT_EQ(wait_child(consumer), 0);
  EXPECT_TRUE(q.empty());
}

TEST_P(TransportTest, TrySendOnAFullConnectionSendsNothing) {
  auto [a, b] = pipe();
  const std::string item(4096, 'y');
  int sent = 0;
  while (a.try_send(item)) ++sent;
  ASSERT_GT(sent, 0);
  for (int i = 0; i < sent; ++i) EXPECT_EQ(b.recv<std::string>(), item);
  EXPECT_FALSE(b.poll());
  a.send(std::string("last"));
  EXPECT_EQ(b.recv<std::string>(), "last");
}

TEST_P(TransportTest, QueuesAndConnectionsAreThemselvesEncodable) {
  auto [a, b] = pipe();
  Queue<Tensor> data;
  pid_t child = fork_child([&, &b = b] {
    a.close();
    auto [reply, q] = b.recv<std::pair<Connection, Queue<Tensor>>>();
    Tensor t = q.get();
    reply.send(t.item<double>() * 2);
  });
  b.close();
  auto [mine, theirs] = pipe();
  a.send(std::make_pair(std::move(theirs), data));
  theirs.close();
  data.put(Tensor::full({1}, 21.0, DType::kFloat64));
  EXPECT_EQ(mine.recv<double>(), 42.0);
  EXPECT_EQ(wait_child(child), 0);
}

TEST_P(TransportTest, ReceivedTensorForwardedToAThirdProcessWithoutCopy) {
  Queue<Tensor> q1, q2;
  Queue<std::string> done;
  pid_t relay = fork_child([&] { q2.put(q1.get()); });
  pid_t sink = fork_child([&] {
    Tensor t = q2.get();
    t.data_ptr<float>()[0] = -1.0f;
    done.put("ok");
  });
  Tensor t = Tensor::zeros({4});
  q1.put(t);
  EXPECT_EQ(done.get(), "ok");
  EXPECT_EQ(t.data_ptr<float>()[0], -1.0f);
  EXPECT_EQ(wait_child(relay), 0);
  EXPECT_EQ(wait_child(sink), 0);
}

TEST_P(TransportTest, TwoThreadsReceivingANewSegmentAtOnceGetOneStorage) {
  // Both threads of the child receive the same fresh segment at the same moment, so both
  // may try to map it: one mapping must win, and the block must be one storage.
  constexpr int kRounds = 200;
  auto [a1, b1] = pipe();
  auto [a2, b2] = pipe();
  pid_t child = fork_child([&, &b1 = b1, &b2 = b2] {
    a1.close();
    a2.close();
    std::barrier sync(2);
    std::vector<Tensor> got1(kRounds), got2(kRounds);
    auto run = [&](Connection& c, std::vector<Tensor>& got) {
      for (int i = 0; i < kRounds; ++i) {
        sync.arrive_and_wait();
        got[static_cast<std::size_t>(i)] = c.recv<Tensor>();
      }
    };
    std::thread t1(run, std::ref(b1), std::ref(got1));
    std::thread t2(run, std::ref(b2), std::ref(got2));
    t1.join();
    t2.join();
    int split = 0;
    for (int i = 0; i < kRounds; ++i) {
      const auto k = static_cast<std::size_t>(i);
      if (!got1[k].storage().is_same(got2[k].storage()) ||
          got1[k].data_ptr<float>() != got2[k].data_ptr<float>())
        ++split;
      EXPECT_EQ(got1[k].data_ptr<float>()[0], static_cast<float>(i));
    }
    EXPECT_EQ(split, 0) << "rounds where one block arrived as two storages";
    b1.send(std::string("done"));
  });
  b1.close();
  b2.close();
  std::vector<Tensor> sent;
  for (int i = 0; i < kRounds; ++i) {
    // 512 KiB: a dedicated segment each, new to the child (we keep them all, so none is
    // freed and reused).
    sent.push_back(Tensor::full({128 * 1024}, static_cast<double>(i), DType::kFloat32));
    a1.send(sent.back());
    a2.send(sent.back());
  }
  EXPECT_EQ(a1.recv<std::string>(), "done");
  EXPECT_EQ(wait_child(child), 0);
}

INSTANTIATE_TEST_SUITE_P(Strategies, TransportTest, testing::kAllStrategies,
                         testing::strategy_name);

}  // namespace
}  // namespace shmtensor
