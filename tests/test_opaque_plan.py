"""Pieces planned around an argument no signature can hold (an HF ``DynamicCache``, which
``generate()`` passes from its first call on): the first such inference call runs eagerly
under the probe, and the submodules it leaves safe are graphed as a piecewise plan's pieces.
On the CPU double, every output compared with an eager twin, bitwise."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg


class _Growing:
    """A cache that grows every step (a new tensor each time): opaque to a signature."""

    def __init__(self):
        self.keys = None

    def update(self, k):
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=1)
        return self.keys


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, cache):
        keys = cache.update(self.k(x))
        return torch.softmax(self.q(x) @ keys.transpose(1, 2), -1) @ keys


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attn = _Attention()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x, cache):
        x = x + self.attn(self.norm(x), cache)
        return x + self.mlp(x)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer() for _ in range(2)])

    def forward(self, x, cache):
        for layer, c in zip(self.layers, cache.layers):
            x = layer(x, c)
        return x


class _Cache:
    """Its layers' growing keys (as HF's DynamicCache holds them)."""

    def __init__(self):
        self.layers = [_Growing(), _Growing()]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _pair():
    torch.manual_seed(0)
    ref = _Model()
    return ref, cg.graphify(copy.deepcopy(ref))


def _decode(ref, g, steps=6):
    rc, c = _Cache(), _Cache()
    for _ in range(steps):
        x = torch.randn(1, 1, 8)
        assert torch.equal(g(x, c), ref(x, rc))


def test_an_opaque_first_call_plans_the_pieces_around_it(sim):
    ref, g = _pair()
    with torch.no_grad():
        _decode(ref, g)
        _decode(ref, g)  # (a second sequence: the pieces' graphs apply again)
    root = g._cudagraphify_state
    assert all("is not a tensor or an immutable value" in r for r in root.eager_calls), root
    for layer in g.layers:
        # a layer gets a layer of the cache (not the argument itself): a piece that runs
        # eagerly and plans its own pieces around it on its first call; its attention gets the
        # same object, so it is no piece of that plan (its calls could never replay), and its
        # projections are the layer's pieces
        own = layer._cudagraphify_state
        assert own.captures == 0 and all("is not a tensor" in r for r in own.eager_calls)
        assert "_cudagraphify_state" not in layer.attn.__dict__
        for piece in (layer.norm, layer.mlp, layer.attn.q, layer.attn.k):
            s = cg.stats(piece)
            assert s.captures == 1 and s.replays >= 8, (piece, s)
    text = str(cg.explain(g.layers[0]))
    assert "mlp (Sequential): graphed [captures=1" in text and "[OPAQUE]" in text, text


def test_only_once_and_not_in_grad_mode_or_without_the_probe(sim):
    ref, g = _pair()
    _decode(ref, g, steps=2)  # grad mode: no plan
    assert g._cudagraphify_state.pieces == []
    off = cg.graphify(copy.deepcopy(ref), probe=False)
    with torch.no_grad():
        _decode(ref, off, steps=2)
    assert off._cudagraphify_state.pieces == [] and off._cudagraphify_state._opaque_planned


def test_a_first_call_in_grad_mode_does_not_keep_a_later_inference_call_from_the_plan(sim):
    # (review helper-18, F2: the eager fast path made in grad mode skipped the plan for good)
    ref, g = _pair()
    _decode(ref, g, steps=2)  # grad mode (as a model(**inputs) before generate())
    with torch.no_grad():
        _decode(ref, g)
    assert g._cudagraphify_state._opaque_planned and g._cudagraphify_state.pieces


def test_a_first_opaque_call_that_raises_is_counted_and_plans_nothing(sim):
    # (the GPU suite's bad-input case: an object() argument raises in forward, as eagerly)
    ref, g = _pair()
    with torch.no_grad():
        for n in (1, 2):
            with pytest.raises(AttributeError):
                g(torch.randn(1, 1, 8), object())
            (count,) = g._cudagraphify_state.eager_calls.values()
            assert count == n
    assert g._cudagraphify_state.pieces == []


def test_explain_lists_a_piece_that_plans_its_own_pieces_as_eager_with_them(sim):
    # (review helper-18, F3: each layer was listed as "graphed", its pieces hidden)
    ref, g = _pair()
    with torch.no_grad():
        _decode(ref, g)
    nodes = {n["path"]: n for n in cg.explain(g).to_dict()["modules"]}
    for layer in ("layers.0", "layers.1"):
        for part in (layer, f"{layer}.attn"):
            assert nodes[part]["status"] == "eager", nodes[part]
            assert any("OPAQUE" in r.get("tags", ()) for r in nodes[part]["reasons"]), nodes[part]
        for piece in ("norm", "mlp", "attn.q", "attn.k"):
            node = nodes[f"{layer}.{piece}"]
            assert node["status"] == "graphed" and node["stats"]["captures"] == 1, node
    assert not any(p.startswith("layers.0.mlp.") for p in nodes)  # inside a graph: not listed


def _graphed(model):
    from cudagraphify import _wrap
    return [n for n, m in model.named_modules()
            if _wrap.graphed_forward(m) is not None or _wrap.STATE in m.__dict__]


def _planned(cls, ref, steps: int):
    """An instance of a graphified class with ``ref``'s weights, after ``steps`` decode steps
    (its pieces planned and captured), each equal to ``ref``'s."""
    m = cls()
    m.load_state_dict(ref.state_dict())
    with torch.no_grad():
        _decode(ref, m, steps=steps)
    return m


def test_ungraphify_of_a_class_releases_its_instances_and_their_pieces(sim):
    # (review helper-18, F4: the instances' pieces stayed graphed and kept their graphs)
    class M(_Model):
        pass

    torch.manual_seed(0)
    ref = _Model()
    cg.graphify(M)
    try:
        m = _planned(M, ref, steps=4)
        states = [s.__dict__["_cudagraphify_state"] for s in m.modules()
                  if "_cudagraphify_state" in s.__dict__]
        assert len(_graphed(m)) > 1 and sum(bool(s.all_graphs()) for s in states) >= 4
    finally:
        cg.ungraphify(M)
    assert _graphed(m) == [] and "forward" not in vars(M)
    assert not any(s.all_graphs() for s in states)  # released
    with torch.no_grad():
        _decode(ref, m, steps=3)  # plain PyTorch again, still right
    assert _graphed(m) == []


class _Pickled(_Model):
    pass


def test_a_class_graphified_model_pickles_after_its_plan_and_plans_again(sim):
    # (review helper-19, F1: its pieces' forwards refused to pickle, so torch.save of a
    # class-graphified HF model failed after its first generate())
    import pickle

    torch.manual_seed(0)
    ref = _Model()
    cg.graphify(_Pickled)
    try:
        m = _planned(_Pickled, ref, steps=4)
        assert m._cudagraphify_state.pieces
        back = pickle.loads(pickle.dumps(m))
        from cudagraphify import _wrap
        # no piece comes back graphed, no state comes back (the root is, through its class)
        assert [n for n, s in back.named_modules()
                if isinstance(s.__dict__.get("forward"), _wrap.GraphedForward)
                or s.__dict__.get(_wrap.STATE) is not None] == []
        with torch.no_grad():
            _decode(ref, back, steps=4)  # plans again, as eager
        assert back._cudagraphify_state.pieces and cg.stats(back.layers[0].mlp).replays > 0
    finally:
        cg.ungraphify(_Pickled)
    with pytest.raises(cg.CudagraphifyUsageError, match="cannot be pickled"):
        pickle.dumps(cg.graphify(_Model()))  # (an instance's own graphify still refuses)


def test_explain_after_a_planned_piece_is_removed(sim):
    # (review helper-19, F2: explain raised AttributeError for the removed layer's plan)
    ref, g = _pair()
    with torch.no_grad():
        _decode(ref, g)
        del g.layers[1], ref.layers[1]
        _decode(ref, g)
    paths = [n["path"] for n in cg.explain(g).to_dict()["modules"]]
    assert "layers.0.mlp" in paths and not any(p.startswith("layers.1") for p in paths)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _Model()
        self.norm = nn.LayerNorm(8)

    def forward(self, x, cache):
        return self.norm(self.model(x, cache))


class _Top(nn.Module):
    """An HF causal LM's shape: the opaque model (its final norm inside it) then a head that
    reads a view of the norm's output (``hidden_states[:, -1:, :]``)."""

    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.head = nn.Linear(8, 5)

    def forward(self, x, cache):
        h = self.inner(x, cache)
        return self.head(h[:, -1:, :])


def test_the_modules_passed_the_opaque_argument_are_not_pieces_so_none_captures_late(sim):
    # The root's plan is made on its first call: inner and inner.model are called with the
    # cache itself, so they are no pieces (their calls could never replay; see
    # _pieces._receivers) and their safe submodules are the root's pieces, captured in the
    # order they run. (Before, inner was a piece that ran eagerly and planned its own pieces a
    # call later: its norm was captured after head, whose input is a view of the norm's
    # output held in the root's forward, so head's graph, captured first, was blocked, then
    # released and captured again.)
    torch.manual_seed(0)
    ref = _Top().eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        rc, c = _Cache(), _Cache()
        for t in range(11):
            x = torch.randn(1, 1, 8)
            assert torch.equal(g(x, c), ref(x, rc)), t
    assert "_cudagraphify_state" not in g.inner.__dict__
    assert "_cudagraphify_state" not in g.inner.model.__dict__
    head = cg.stats(g.head)
    assert head.captures == 1 and head.replays >= 8 and not head.eager_calls, head
    assert g.head._cudagraphify_state._recaptures == 0
    assert cg.stats(g.inner.norm).replays >= 8
    text = str(cg.explain(g))
    assert "inner (_Inner): eager" in text and "[OPAQUE]" in text, text


# -- a piece captures a signature on its second sight (_engine._SEEN_ONCE) ----------------------

def _generate(ref, g, prompt: int, steps: int = 4) -> None:
    """A prefill of ``prompt`` tokens then ``steps`` decode steps, each equal to eager's."""
    rc, c = _Cache(), _Cache()
    with torch.no_grad():
        for t in range(steps + 1):
            x = torch.randn(1, prompt if t == 0 else 1, 8)
            assert torch.equal(g(x, c), ref(x, rc)), (prompt, t)


def test_a_prompt_length_seen_once_costs_its_pieces_no_capture(sim):
    # Around an opaque argument (a growing cache, as HF's DynamicCache) the root has no
    # signature, so its pieces see every prefill length first: each length seen once runs
    # eagerly (no capture, no graph memory); the decode step's signature is captured on its
    # second sight and replays; a length that comes again is captured then.
    ref, g = _pair()
    for prompt in (5, 7, 9, 11):
        _generate(ref, g, prompt)
    s = cg.stats(g.layers[0].mlp)
    # (the first prefill planned the pieces; seen once: lengths 7, 9, 11 and the decode step)
    assert (s.seen_once, s.captures, s.graphs) == (4, 1, 1), s
    assert s.replays == 4 * 4 - 2, s  # the decode steps but the first two (seen, captured)
    _generate(ref, g, 7)
    s = cg.stats(g.layers[0].mlp)
    assert (s.seen_once, s.captures, s.graphs) == (4, 2, 2), s
    lines = [l for l in str(cg.explain(g)).splitlines() if l.strip().startswith("layers.0.mlp ")]
    assert len(lines) == 1 and "[captures=2 seen_once=4 replays=" in lines[0], lines


def test_the_signatures_a_piece_saw_once_are_bounded(sim, monkeypatch):
    from cudagraphify import _engine
    monkeypatch.setattr(_engine, "_SEEN_ONCE", 3)
    ref, g = _pair()
    # (prompt 2 plans the root's pieces, 3 the layers' own: the MLP sees 4 first)
    for prompt in (2, 3, 4, 5, 6, 7, 4, 6):  # 7 pushes 4 out; 6 comes back while remembered
        _generate(ref, g, prompt, steps=0)
    state = g.layers[0].mlp._cudagraphify_state
    s = cg.stats(g.layers[0].mlp)
    assert (s.seen_once, s.captures) == (5, 1), s  # 4, 5, 6, 7 and 4 again; 6 captured
    assert len(state._seen_once) == 2  # (7 and 4: 6 left it when captured)


def test_capture_sizes_captures_the_pieces_at_first_sight(sim):
    ref, g = _pair()
    _generate(ref, g, 3, steps=0)  # (plans the pieces)
    with torch.no_grad():
        done = cg.capture_sizes(g, lambda n: (torch.randn(1, n, 8), _Cache()), [4, 6],
                                progress=False)
    s = cg.stats(g.layers[0].mlp)
    assert (s.captures, s.seen_once) == (2, 0), (s, done)
    for prompt in (4, 6):
        _generate(ref, g, prompt, steps=0)
    after = cg.stats(g.layers[0].mlp)
    assert (after.captures, after.seen_once, after.replays - s.replays) == (2, 0, 2), after


def test_capture_sizes_on_one_thread_leaves_another_threads_first_sights_eager(sim):
    # capture_sizes makes pieces capture at first sight in its own thread only: a call of
    # another graphified model on another thread meanwhile still runs a new length eagerly
    import threading

    ref, g = _pair()
    other_ref, other = _pair()
    _generate(ref, g, 3, steps=0)  # (plans the pieces)
    for prompt in (2, 3):  # (the root's pieces, then the layers' own)
        _generate(other_ref, other, prompt, steps=0)
    seen = []

    def inputs(n):
        if not seen:  # (once, while capture_sizes runs)
            t = threading.Thread(target=lambda: seen.append(_generate(other_ref, other, 5,
                                                                        steps=0)))
            t.start()
            t.join()
        return torch.randn(1, n, 8), _Cache()

    with torch.no_grad():
        cg.capture_sizes(g, inputs, [4], progress=False)
    assert seen == [None]
    assert cg.stats(g.layers[0].mlp).seen_once == 0
    s = cg.stats(other.layers[0].mlp)
    assert (s.seen_once, s.captures) == (1, 0), s  # length 5 seen once: no capture of it
