"""What the tests of sync-free code share: the aten ops that make the host wait for the GPU, and
a recorder of every op a block issues (on the CPU, where nothing waits, the ops are the same)."""

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# Ops that make the host wait for the GPU when their tensors live there: reading a value
# (.item(), .tolist(), int(t)), an output whose size depends on the data, or a tensor made
# from Python data on its way to the device (assigning a Python number into a CUDA tensor
# is one: a host-to-device copy from pageable memory).
SYNCHRONISING_OPS = {
    "aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.lift_fresh",
    "aten.repeat_interleave", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim",
    "aten.equal", "aten.is_nonzero",
}


class OpRecorder(TorchDispatchMode):
    """Inside `with OpRecorder() as recorder:`, every aten op run is counted: `recorder.ops`
    (the set of their names) and `recorder.counts` (how often each ran)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    @property
    def ops(self) -> set[str]:
        return set(self.counts)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))
