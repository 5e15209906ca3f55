// EXPECT_ERROR (tests/support/expect_error.h) passes on the right type and words, and fails
// when nothing is thrown, another type is, or the message says something else.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <stdexcept>

#include "shmtensor/error.h"
#include "support/expect_error.h"

namespace shmtensor {
namespace {

void throw_protocol() { throw ProtocolError("a frame exceeds the message"); }

TEST(ExpectErrorTest, PassesOnTheTypeOrASubclassWithTheWords) {
  EXPECT_ERROR(throw_protocol(), ProtocolError, "exceeds the message");
  EXPECT_ERROR(throw_protocol(), Error, "a frame");  // a base class
}

TEST(ExpectErrorTest, FailsWhenNothingOrAnotherTypeOrOtherWordsAreThrown) {
  EXPECT_NONFATAL_FAILURE(EXPECT_ERROR((void)0, ProtocolError, "x"), "threw nothing");
  EXPECT_NONFATAL_FAILURE(EXPECT_ERROR(throw std::logic_error("y"), ProtocolError, "y"),
                          "threw another exception than ProtocolError: y");
  EXPECT_NONFATAL_FAILURE(EXPECT_ERROR(throw_protocol(), ProtocolError, "other words"),
                          "with another message");
}

}  // namespace
}  // namespace shmtensor
