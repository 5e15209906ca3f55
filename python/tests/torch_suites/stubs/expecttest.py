"""Stand-in for the `expecttest` package, which Debian does not ship.

torch.testing._internal.common_utils imports it for two things: its TestCase base class
and the ACCEPT flag (whether assertExpected rewrites .expect files). test_multiprocessing.py
and test_dataloader.py use neither expect files nor inline expectations, so a plain
unittest.TestCase and ACCEPT = False are all they need. A test that does call
assertExpectedInline is skipped, loudly, rather than passing without checking anything.
"""
import unittest

ACCEPT = False


class TestCase(unittest.TestCase):
    def assertExpectedInline(self, actual, expect, skip=0):  # noqa: N802 (expecttest's name)
        raise unittest.SkipTest("assertExpectedInline needs the real expecttest package")

    def assertExpectedRaisesInline(self, exc_type, callable, expect, *args, **kwargs):  # noqa: N802
        raise unittest.SkipTest("assertExpectedRaisesInline needs the real expecttest package")
