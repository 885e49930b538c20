"""A key/value cache for incremental (prefill + decode) inference with the training modules.

Layout: every layer holds K and V buffers [B, Hkv, S_max, Dh]. All rows of the batch write the
same slots (one shared fill counter), so a batch of prompts of different lengths is
left-padded: padding slots are marked invalid and never read by a real query, and each row's
RoPE positions count only its valid tokens (so a prompt gets the same positions 0..n-1 as
when it runs alone).

A forward with a cache:

    cache = KVCache(n_layers=..., batch_size=B, n_kv_heads=..., head_dim=..., max_len=...)
    cache.mark_valid(prompt_mask)                  # left padding of the next forward's tokens
    logits = model(prompt_ids, kv_cache=cache)     # prefill, [B, P]
    logits = model(next_ids, kv_cache=cache)       # decode, [B, 1]

The model calls `begin` once per forward (which reserves the slots, returns the RoPE positions
and builds the attention mask) and hands `layer(i)` to its i-th block.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K/V buffers [B, Hkv, S_max, Dh] (V may have its own `v_head_dim`), the
    slots' validity [B, S_max] and each row's next RoPE position [B]."""

    def __init__(
        self,
        *,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        v_head_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        k_shape = (batch_size, n_kv_heads, max_len, head_dim)
        v_shape = (batch_size, n_kv_heads, max_len, head_dim if v_head_dim is None else v_head_dim)
        self.k = [torch.zeros(k_shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(v_shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0
        """Slots filled so far (the same for every row)."""
        self._start = 0
        self._mask: torch.Tensor | None = None
        self._pending_valid: torch.Tensor | None = None

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        *,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A cache shaped for `model` (a titan decoder: its `layers` and its
        `kv_cache_layout()` -> (heads, K channels, V channels), which multi-head latent
        attention sets to its latent and rotated key part), with the model's parameter dtype
        unless `dtype` is given."""
        heads, k_dim, v_dim = model.kv_cache_layout()
        param = next(model.parameters())
        return cls(
            n_layers=len(model.layers),
            batch_size=batch_size,
            n_kv_heads=heads,
            head_dim=k_dim,
            v_head_dim=v_dim,
            max_len=max_len,
            device=device if device is not None else param.device,
            dtype=dtype if dtype is not None else param.dtype,
        )

    def mark_valid(self, valid: torch.Tensor) -> None:
        """Mark which tokens [B, S] of the next forward are real (True) or padding (False);
        without a call every token of a forward is real."""
        self._pending_valid = valid

    def begin(self, seq_len: int, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Reserve the next `seq_len` slots for a forward of [B, seq_len] tokens and return
        their RoPE positions [B, seq_len].

        `valid` [B, seq_len] (bool) marks real tokens; False slots (left padding) are never
        read by real queries and do not advance the row's position. Builds the mask every
        layer uses: a query may read a key when the key's slot is not later than its own and
        is valid, or is the query's own slot (so a padding query is never fully masked).
        """
        start, end = self.length, self.length + seq_len
        if end > self.max_len:
            raise ValueError(
                f"KV cache overflow: {end} slots needed, the cache holds {self.max_len}; "
                "allocate it with max_len >= prompt length + new tokens"
            )
        device = self.valid.device
        if valid is None:
            valid, self._pending_valid = self._pending_valid, None
        if valid is None:
            valid = torch.ones(self.batch_size, seq_len, dtype=torch.bool, device=device)
        valid = valid.to(device=device, dtype=torch.bool)
        if valid.shape != (self.batch_size, seq_len):
            raise ValueError(
                f"KV cache: valid mask has shape {tuple(valid.shape)}, expected "
                f"{(self.batch_size, seq_len)} (batch size, tokens of this forward)"
            )
        self.valid[:, start:end] = valid
        # Position of each token = the row's valid tokens before it; padding gets the position
        # of the next real token (any value works, nothing reads it).
        before = torch.cumsum(valid.long(), dim=1) - valid.long()
        positions = self.next_position[:, None] + before
        self.next_position += valid.long().sum(dim=1)
        query_slot = torch.arange(start, end, device=device)
        key_slot = torch.arange(end, device=device)
        causal = key_slot[None, :] <= query_slot[:, None]
        own = key_slot[None, :] == query_slot[:, None]
        self._mask = ((causal[None] & self.valid[:, None, :end]) | own[None]).unsqueeze(1)
        self._start, self.length = start, end
        return positions

    def repeat_interleave(self, repeats: int) -> KVCache:
        """A cache of `repeats` consecutive copies of every row (a prompt prefilled once,
        then decoded into a group of completions)."""
        other = object.__new__(KVCache)
        other.k = [t.repeat_interleave(repeats, dim=0) for t in self.k]
        other.v = [t.repeat_interleave(repeats, dim=0) for t in self.v]
        other.valid = self.valid.repeat_interleave(repeats, dim=0)
        other.next_position = self.next_position.repeat_interleave(repeats, dim=0)
        other.batch_size, other.max_len = self.batch_size * repeats, self.max_len
        other.length, other._start, other._mask, other._pending_valid = self.length, 0, None, None
        return other

    def layer(self, index: int) -> LayerKVCache:
        """The view of layer `index` for the forward started by the last `begin`."""
        return LayerKVCache(self, index)


class LayerKVCache:
    """One layer's slice of a `KVCache` during one forward: stores the new K/V and returns
    all K/V so far with the attention mask [B, 1, S_new, S_total]."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    @property
    def mask(self) -> torch.Tensor:
        """Boolean attention mask [B, 1, S_new, S_total] (True = may attend)."""
        return self.cache._mask

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's k, v [B, Hkv, S_new, Dh] and return the layer's keys and
        values over every filled slot [B, Hkv, S_total, Dh]."""
        c = self.cache
        start, end = c._start, c.length
        c.k[self.index][:, :, start:end] = k
        c.v[self.index][:, :, start:end] = v
        return c.k[self.index][:, :, :end], c.v[self.index][:, :, :end]


__all__ = ["KVCache", "LayerKVCache"]
