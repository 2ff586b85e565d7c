"""[finding] Thread A warms a graphified callable up on stream s (its graphs replay there: s
is the stream that replayed last) and captures it in a torch.cuda.graph of its own ON s
(``stream=s``, capture_error_mode="thread_local"); meanwhile thread B calls it on its own
stream. B's replay orders after the stream that replayed last (_engine._replay:
``order_after(holder._stream_token)``), A's capturing stream: B's stream joins A's capture,
B's replay is captured instead of run (B's output is not eager's) and A's capture ends
unjoined. For "whole" (one graph) and "pieces" (a root's implicit region).
[control] the same with A capturing on torch.cuda.graph's own stream (not the last one)."""
from common import capture_race, finish, isolated, rand


def scenario(kind, same_stream):
    xb = rand()
    where = "the stream that replayed last" if same_stream else "its own capture stream"
    capture_race(kind, same_stream, lambda g, call: [(xb, call(g, xb))],
                 f"[{'finding' if same_stream else 'control'}] {kind}, A captures on {where}")


isolated({f"{kind}_{'same' if same else 'own'}": (lambda k=kind, s=same: scenario(k, s))
          for kind in ("whole", "pieces") for same in (False, True)})
finish()
