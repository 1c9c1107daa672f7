"""Ray Train (2.60): the storage of a run's experiment, which every try of the run shares. Ray's TrainContext hands
out its StorageContext, whose attributes are not a documented API; Ray's own record of the last checkpoint cannot
tell a retried run from a new one (a report may not be committed yet when a worker dies)."""

from __future__ import annotations

from finetune.hooks import check_pin

HOOKS = ("TrainContext.get_storage", "StorageContext.experiment_fs_path", "StorageContext.storage_filesystem")
check_pin("ray", "2.60.0", HOOKS)


def started_before() -> bool:
    """Whether an earlier try of this Ray run started (Ray starts the workers again after one died); marks this one."""
    import ray.train

    storage = ray.train.get_context().get_storage()
    marker = f"{storage.experiment_fs_path}/finetune_started"
    if storage.storage_filesystem.get_file_info(marker).size is not None:
        return True
    storage.storage_filesystem.create_dir(storage.experiment_fs_path)
    with storage.storage_filesystem.open_output_stream(marker):
        pass
    return False
