"""[finding] Thread A warms up on stream s and captures on s (as a_same_stream); meanwhile
thread B moves the graphified module's weight (``.data = clone``: new memory) and calls it:
B's call releases the graphs (invalidate -> release) after draining the stream that
replayed last, A's capturing s (CudaBackend.drain checks only B's own stream):
cudaStreamSynchronize on a capturing stream fails (B's call raises) and invalidates A's
capture. [control] the same with A capturing on torch.cuda.graph's own stream."""
from common import capture_race, finish, isolated, rand


def scenario(same_stream):
    def between(g, call):
        g.weight.data = g.weight.data.clone()  # (new memory: B's call releases the graphs)
        xb = rand()
        return [(xb, call(g, xb))]
    where = "the stream that replayed last" if same_stream else "its own capture stream"
    capture_race("whole", same_stream, between,
                 f"[{'finding' if same_stream else 'control'}] B releases while A captures on "
                 f"{where}")


isolated({"own": lambda: scenario(False), "same": lambda: scenario(True)})
finish()
