"""Custom modules with a fake static cache: non-idempotent writes, a shared device counter, and
a layer returning a cache tensor it does not touch (the CPU double's silent wrong result)."""
import torch
from torch import nn
from common import custom_run, kv_cache, DEV


class Attn(nn.Module):
    def __init__(self, idx, d=64):
        super().__init__()
        self.layer_idx = idx
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, x, past_key_values=None, pos=None):
        layer = past_key_values.layers[self.layer_idx]
        layer.keys.index_copy_(1, pos, self.k(x))
        layer.values.index_copy_(1, pos, self.v(x))
        att = torch.softmax(x @ layer.keys.transpose(1, 2), -1)
        return x + att @ layer.values


class Accumulate(Attn):
    def forward(self, x, past_key_values=None, pos=None):
        layer = past_key_values.layers[self.layer_idx]
        layer.keys.index_add_(1, pos, self.k(x))
        layer.values.mul_(0.5).index_add_(1, pos, self.v(x))
        att = torch.softmax(x @ layer.keys.transpose(1, 2), -1)
        return x + att @ layer.values


class Roll(Attn):
    def forward(self, x, past_key_values=None, pos=None):
        layer = past_key_values.layers[self.layer_idx]
        layer.keys.copy_(torch.roll(layer.keys, -1, 1))
        layer.keys[:, -1:].copy_(self.k(x))
        att = torch.softmax(x @ layer.keys.transpose(1, 2), -1)
        return x + att @ layer.keys


class Counter(Attn):
    def forward(self, x, past_key_values=None, pos=None):
        c = past_key_values
        layer = c.layers[self.layer_idx]
        layer.keys.index_copy_(1, c.cursor % layer.max_len, self.k(x))
        c.cursor.add_(1)
        att = torch.softmax(x @ layer.keys.transpose(1, 2), -1)
        return x + att @ layer.keys


class ReturnsUntouched(Attn):
    """Writes its keys; returns its values tensor without touching it."""

    def forward(self, x, past_key_values=None, pos=None):
        layer = past_key_values.layers[self.layer_idx]
        layer.keys.index_copy_(1, pos, self.k(x))
        return x + layer.keys.mean(1, keepdim=True), layer.values


class Model(nn.Module):
    def __init__(self, layer, n=4):
        super().__init__()
        self.layers = nn.ModuleList([layer(i) for i in range(n)])

    def forward(self, x, cache, pos):
        for layer in self.layers:
            x = layer(x, past_key_values=cache, pos=pos)
        return x


class ModelWritesValues(Model):
    def forward(self, x, cache, pos):
        outs = []
        for i, layer in enumerate(self.layers):
            x, v = layer(x, past_key_values=cache, pos=pos)
            outs.append(v.sum(1, keepdim=True))
        return torch.cat([x] + outs, 1)


def fill_values_from_step_3(cache, t):
    # (outside the layers: the model's owner writes the values; zero in every layer before)
    if t >= 3:
        for i, layer in enumerate(cache.layers):
            layer.values[:, t] = float(i + 1) * (t + 1)


if __name__ == "__main__":
    custom_run("custom_baseline", Model, Attn, kv_cache)
    custom_run("custom_accumulate_nonidempotent", Model, Accumulate, kv_cache)
    custom_run("custom_ring_buffer_roll", Model, Roll, kv_cache)
    custom_run("custom_shared_device_counter", Model, Counter,
               lambda: kv_cache(cursor=torch.zeros(1, dtype=torch.long, device=DEV)))
    custom_run("custom_returns_untouched_cache_tensor", ModelWritesValues, ReturnsUntouched,
               kv_cache, pre=fill_values_from_step_3)
