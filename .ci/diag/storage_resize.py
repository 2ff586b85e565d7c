"""CUDA: a storage's resize_ always moves its data (what _segrun.SegmentPlan.held relies on: a use
count and a data pointer per storage, no size); a tensor's shrink leaves its storage."""

import torch
for n in (4096, 2048, 8192, 0):
    t = torch.zeros(1024, device="cuda"); st = t.untyped_storage(); p = st.data_ptr()
    st.resize_(n)
    print(f"{'PASS' if st.data_ptr() != p else 'FAIL'} cuda storage resize_({n}) from 4096 bytes moves its data ({p:#x} -> {st.data_ptr():#x})")
t = torch.zeros(1024, device="cuda"); st = t.untyped_storage(); p = st.data_ptr(); t.resize_(10)
print(f"{'PASS' if st.data_ptr() == p and st.nbytes() == 4096 else 'FAIL'} a tensor's shrink leaves its storage")
