// EXPECT_ERROR(statement, Type, "words"): the statement throws a Type (or a subclass) whose
// what() contains "words"; a test failure names what was thrown instead, or that nothing
// was. The exact-error assertion the tests otherwise write by hand with try/catch.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <exception>
#include <string>

#define EXPECT_ERROR(statement, Type, words)                                             \
  do {                                                                                   \
    try {                                                                                \
      statement;                                                                         \
      ADD_FAILURE() << #statement " threw nothing; expected " #Type " saying \""         \
                    << (words) << "\"";                                                  \
    } catch (const Type& shmtensor_expect_error_e) {                                     \
      EXPECT_THAT(std::string(shmtensor_expect_error_e.what()), ::testing::HasSubstr(words)) \
          << #statement " threw " #Type " with another message";                         \
    } catch (const std::exception& shmtensor_expect_error_e) {                           \
      ADD_FAILURE() << #statement " threw another exception than " #Type ": "            \
                    << shmtensor_expect_error_e.what();                                  \
    }                                                                                    \
  } while (false)
