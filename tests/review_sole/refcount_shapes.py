"""Standalone (no torch): the counting of cudagraphify/_outobjects.py copied, with see_through's
and _describe's call shapes, on a stand-in pytree (tuple/list/dict), for several Pythons.
Prints one line per case: the value _others gives and whether it equals the calibration."""
import gc, sys


class Slot:
    __slots__ = ("obj", "tensors", "context")
    def __init__(self, obj, tensors, context):
        self.obj, self.tensors, self.context = obj, tensors, context


class Cache:  # stands for a DynamicCache (a plain object with __dict__)
    def __init__(self):
        self.layers = [Layer(), Layer()]


class Layer:
    pass


def _refs_from(holders, obj):
    n = 0
    for h in holders:
        for r in gc.get_referents(h):
            if r is obj:
                n += 1
            elif type(r) is dict and r is getattr(h, "__dict__", None):
                n += sum(1 for v in r.values() if v is obj)
    return n


def _others(obj, holders):
    return sys.getrefcount(obj) - _refs_from(holders, obj)


def _calibrated():
    holder = [Slot(None, [], ())]
    for x in holder:
        return _others(x, [holder])
    raise AssertionError


ALONE = _calibrated()


def _is_leaf(x):
    return type(x) not in (tuple, list, dict)


def _children(x):
    return list(x.values()) if type(x) is dict else list(x)


def _leaves(out):
    if _is_leaf(out):
        return [out]
    return [y for c in _children(out) for y in _leaves(c)]


def _containers(out):
    found, todo = [], [out]
    while todo:
        x = todo.pop()
        if _is_leaf(x):
            continue
        found.append(x)
        todo.extend(_children(x))
    return found


def _tree_flatten(tree, is_leaf):  # torch.utils._pytree.tree_flatten's shape (torch 2.13)
    def helper(node, leaves):  # (recursive closure: helper -> its cell -> helper, a cycle)
        if is_leaf(node) or _is_leaf(node):
            leaves.append(node)
            return None
        return [helper(c, leaves) for c in _children(node)]
    leaves = []
    spec = helper(tree, leaves)
    return leaves, spec


def _containers_torch(out):  # _outobjects._containers as written (a lambda over x)
    found, todo = [], [out]
    while todo:
        x = todo.pop()
        if _is_leaf(x):
            continue
        found.append(x)
        todo.extend(_tree_flatten(x, is_leaf=lambda y: y is not x)[0])
    return found


def see_through_counts(out, containers=_containers):
    leaves = _leaves(out)
    found = [x for x in leaves if isinstance(x, Cache)]
    del leaves
    holders = containers(out) + [found]
    res = []
    for x in found:
        res.append(_others(x, holders))
    del x
    return res


def describe_counts(obj):
    res = []
    d = obj.__dict__
    for name, value in d.items():
        if name == "layers":
            for item in value:
                res.append(_others(item, [value]))
    return res


def main():
    print(sys.version.split()[0], "ALONE", ALONE)
    cases = {
        "tuple(logits, c)": lambda: (1.0, Cache()),
        "tuple(c, logits)": lambda: (Cache(), 1.0),
        "dict{logits, c}": lambda: {"l": 1.0, "c": Cache()},
        "nested([x,(c,)])": lambda: [1.0, (Cache(),)],
        "c alone": lambda: Cache(),
    }
    for name, make in cases.items():
        vals = see_through_counts(make())
        print(f"{name:20s} see_through {vals} sole={[v == ALONE for v in vals]}")
    for name, make in cases.items():
        vals = see_through_counts(make(), _containers_torch)
        print(f"{name:20s} torch-like flatten {vals} sole={[v == ALONE for v in vals]}")
    print(f"{'layers':20s} describe {describe_counts(Cache())} (ALONE {ALONE})")


main()
