"""`SafeFileSystemReader`: torch.distributed.checkpoint's FileSystemReader, except that `.metadata`
(which the stock reader unpickles with plain pickle, running whatever the file names) is read by
`safe_pickle.read_dcp_metadata`, which allows only torch.distributed.checkpoint's own metadata
classes; tensors are read by DCP itself with torch.load(weights_only=True). Apart from
`safe_pickle` because importing torch.distributed.checkpoint takes seconds: only the modules that
load checkpoints through DCP import this one."""
from torch.distributed.checkpoint import FileSystemReader

from megatron.core.checkpointing.safe_pickle import read_dcp_metadata


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        metadata = read_dcp_metadata(self.path)
        metadata.storage_meta.load_id = self.load_id
        return metadata
