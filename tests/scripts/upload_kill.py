"""For the test scripts: SIGKILL this process inside a sharded checkpoint's upload to an object store."""

import os
import signal


def die_during_shard_upload(rank: int, nth: int) -> None:
    """Rank ``rank`` (``RANK`` as its process sees it when writing) dies in its ``nth`` ``.distcp`` upload, after
    the data went out and before the file was closed."""
    import fsspec.spec

    opened = fsspec.spec.AbstractBufferedFile.__init__
    writes = []

    def watched(file, *args, **kwargs):
        opened(file, *args, **kwargs)
        if "w" in file.mode and file.path.endswith(".distcp") and int(os.environ["RANK"]) == rank:
            writes.append(file.path)
            if len(writes) == nth:
                original_write = file.write

                def write_then_die(data):
                    original_write(data)
                    os.kill(os.getpid(), signal.SIGKILL)

                file.write = write_then_die

    fsspec.spec.AbstractBufferedFile.__init__ = watched
