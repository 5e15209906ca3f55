import shmtensor


def test_import():
    assert shmtensor.Tensor.__name__ == "Tensor"
