"""What run_torch_suites.py runs, and the regressions it accepts (each with its reason).

Test ids are pytest node ids relative to torch's test/ directory.
"""

# The files, as paths inside Debian's pytorch source tree.
FILES = ["test/test_multiprocessing.py", "test/test_dataloader.py"]

# Tests that may pass stock and fail with shmtensor.torch.install() active. Each entry holds
# a fragment the failure's text must contain (so the test failing in another way is still a
# regression) and the reason the failure is expected.
ALLOWED_REGRESSIONS = {
    "test_multiprocessing.py::TestMultiprocessing::test_fs": (
        "self.assertTrue(lc.has_shm_files(wait=False))",
        "asserts that putting a storage on a queue under the file_system strategy creates a "
        "/dev/shm/torch_<pid>_* file: torch's own naming; with install() the storage goes into "
        "a shmtensor arena (/dev/shm/shmtensor_*), so no torch_ file appears",
    ),
}

# The quick subset (what `make test` runs; SHMTENSOR_TORCH_SUITES=full or --full runs all, and
# torch's @slowTest tests too: test_proper_exit, 74 s each): every test except these, which took 5 s or more each stock on the 2-core development
# machine (seconds as measured there, loaded by other builds) and whose paths the remaining
# tests cover: the persistent-workers variants of tests that run stock in TestDataLoader,
# and the datapipe shuffling loops. TestDataLoader.test_multiprocessing_contexts (18 s; fork,
# spawn and forkserver workers) stays in the quick subset.
QUICK_DESELECT = {
    "test_dataloader.py::IntegrationTestDataLoaderDataPipe::test_shuffler_iterdatapipe": 76,
    "test_dataloader.py::TestDataLoaderPersistentWorkers::test_multiprocessing_contexts": 17,
    "test_dataloader.py::TestDataLoader::test_multiprocessing_iterdatapipe": 13,
    "test_dataloader.py::TestDataLoaderPersistentWorkers::test_multiprocessing_iterdatapipe": 11,
    "test_dataloader.py::TestDataLoaderPersistentWorkers::test_get_worker_info": 8,
    "test_dataloader.py::TestDataLoader::test_batch_sampler": 7,
    "test_dataloader.py::TestDataLoaderPersistentWorkers::test_batch_sampler": 7,
    "test_dataloader.py::TestDataLoader::test_sampler": 7,
    "test_dataloader.py::TestDataLoaderPersistentWorkers::test_sampler": 5,
    "test_dataloader.py::TestDataLoader::test_multiple_dataloaders": 5,
    "test_dataloader.py::TestDataLoaderPersistentWorkers::test_multiple_dataloaders": 5,
}
