"""A preallocated KV cache written at explicit positions, behind transformers' Cache interface.

Each layer owns one [batch, kv_heads, capacity, head_dim] buffer for keys and one for values, allocated on
first use: views into one block for the keys of all layers and one for the values. Two large blocks rather
than two per layer, because glibc serves an allocation past its (adaptive, at most 32 MiB) mmap threshold with
fresh pages of its own and gives them back when the block is freed; per-layer buffers of a few MiB come from
the heap instead, where a closed reading's cache stayed resident and fragmented it (Qwen2.5 1.5B, 8k tokens:
a second reading in one process peaked ~220 MiB higher than the first). The blocks are not zeroed: a slot is
read only after it was written (attention sees [:length]), so pages become resident as the cache fills.

A forward pass writes its new keys/values into slots [length, length + n) and attention reads the
view [:length + n]: no torch.cat, so a decode step never copies the cache, and cutting the cache back to a
shorter length is moving one integer (O(1), no tensor is touched). This is what makes WiM's "write a margin,
then cut it off" cheap.

Models with sliding-window layers cannot use it (their layers keep only a window); for them `make_cache` falls
back to transformers' DynamicCache with past recording, whose crop is correct but copies.
"""
from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache


class CacheFull(RuntimeError):
    pass


class PreallocatedLayer(CacheLayerMixin):
    is_croppable = True
    is_sliding = False

    def __init__(self, capacity: int, blocks: "_Blocks", index: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.blocks, self.index = blocks, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, k_dim = key_states.shape
        self.device = key_states.device
        self.keys = self.blocks.view("keys", self.index, (batch, heads, self.capacity, k_dim), key_states.dtype,
                                     self.device)
        self.values = self.blocks.view("values", self.index, (batch, heads, self.capacity, value_states.shape[-1]),
                                       value_states.dtype, self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise CacheFull(f"KV cache full: {end} tokens > capacity {self.capacity}")
        self.keys[:, :, self.length:end].copy_(key_states)
        self.values[:, :, self.length:end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        # transformers' convention: a negative count removes that many tokens.
        self.length = max(0, self.length - abs(tokens_to_remove))

    def reset(self) -> None:
        self.length = 0


class _Blocks:
    """The keys (or values) of every layer in one block, made when the first layer asks (see the module's
    docstring); a layer whose shape differs from the first one's gets a buffer of its own."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.blocks: dict[str, torch.Tensor] = {}

    def view(self, kind: str, index: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
             ) -> torch.Tensor:
        block = self.blocks.get(kind)
        if block is None:
            block = self.blocks[kind] = torch.empty(self.num_layers, *shape, dtype=dtype, device=device)
        if tuple(block.shape[1:]) != shape or block.dtype != dtype or block.device != device:
            return torch.empty(shape, dtype=dtype, device=device)
        return block[index]


class PreallocatedCache(Cache):
    kind = "preallocated"

    def __init__(self, num_layers: int, capacity: int):
        blocks = _Blocks(num_layers)
        super().__init__(layers=[PreallocatedLayer(capacity, blocks, i) for i in range(num_layers)])
        self.capacity = capacity

    @property
    def length(self) -> int:
        return self.layers[0].length

    def truncate(self, length: int) -> None:
        """Cut the cache back to its first `length` tokens: O(1), the buffers are left as they are and the next
        write overwrites the stale slots."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        for layer in self.layers:
            layer.length = length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))

    @torch.inference_mode()  # the buffers are inference tensors
    def evict(self, start: int, count: int, rotate) -> None:
        """Drop slots [start, start + count) and move the later slots down by `count` (the sliding cache).
        A cached key carries its position in its rotation, so `rotate(keys, -count)` re-positions the moved
        keys to their new slots; values carry no position and are moved as they are."""
        if count <= 0:
            return
        if not 0 <= start <= start + count <= self.length:
            raise ValueError(f"cannot evict [{start}, {start + count}) from a cache of {self.length} tokens")
        for layer in self.layers:
            end = layer.length
            if layer.is_initialized:
                keys = layer.keys[:, :, start + count:end].clone()
                layer.keys[:, :, start:end - count] = rotate(keys, -count)
                layer.values[:, :, start:end - count] = layer.values[:, :, start + count:end].clone()
            layer.length = end - count

    def state(self) -> dict[str, torch.Tensor]:
        """The filled part of every layer, as named tensors (for saving a window's cache)."""
        out = {}
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                out[f"k{i}"] = layer.keys[:, :, :layer.length]
                out[f"v{i}"] = layer.values[:, :, :layer.length]
        return out

    def load_state(self, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> None:
        for i, layer in enumerate(self.layers):
            layer.length = 0
            with torch.inference_mode():
                layer.update(tensors[f"k{i}"].to(device), tensors[f"v{i}"].to(device))

    def save(self, path) -> None:
        """Write the filled part to a safetensors file (a window's cache, kept for follow-up questions)."""
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in self.state().items()}, str(path))

    @classmethod
    def load(cls, path, capacity: int, device: torch.device | str = "cpu") -> "PreallocatedCache":
        from safetensors.torch import load_file
        tensors = load_file(str(path))  # memory-mapped by safetensors, copied once into the buffers
        cache = cls(len(tensors) // 2, capacity)
        cache.load_state(tensors, device)
        return cache


def key_rotation(model):
    """rotate(keys, delta): keys cached at position p, as they would be at position p + delta.

    RoPE (transformers' `rotary_emb` + `apply_rotary_pos_emb`, GPT-NeoX layout) turns each pair of key
    dimensions by the angle position * inv_freq, so k(p + delta) = R(delta) k(p): one more rotation by the
    angle difference. That holds only where inv_freq does not depend on the sequence (not for `dynamic` or
    `longrope` scaling), hence the check. `attention_scaling` multiplies cos and sin, so it is divided out."""
    from transformers.models.llama.modeling_llama import rotate_half

    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if rotary is None or rope_type in ("dynamic", "longrope"):
        raise ValueError("the sliding cache needs a model with plain rotary position embeddings (RoPE)")
    scaling = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)

    @torch.inference_mode()
    def rotate(keys: torch.Tensor, delta: int) -> torch.Tensor:
        position = torch.tensor([[delta]], device=keys.device)
        cos, sin = rotary(keys, position_ids=position)  # [1, 1, head_dim], broadcast over batch/heads/slots
        if cos.shape[-1] != keys.shape[-1]:
            raise ValueError("the sliding cache needs RoPE over the whole head (no partial rotary)")
        return keys * (cos / scaling) + rotate_half(keys) * (sin / scaling)

    return rotate


class RecordingDynamicCache(DynamicCache):
    """Fallback for sliding-window models: transformers' own cache, told to keep past states so that a crop
    can restore the state before a margin exactly. Correct, but every step concatenates (copies)."""
    kind = "dynamic (sliding-window fallback)"

    def __init__(self, config, capacity: int):
        super().__init__(config=config)
        self.activate_past_recording()
        self.capacity = capacity

    @property
    def length(self) -> int:
        return self.get_seq_length()

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        if length < self.length:
            self.crop(length - self.length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))


def has_sliding_layers(config) -> bool:
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or []
    return any(t != "full_attention" for t in layer_types) or bool(
        getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None))


def cache_keyword(model) -> str:
    """The keyword `model`'s forward takes its KV cache by: `cache` from transformers 5.24 on, `past_key_values`
    before it (5.20.2, the newest transformers for Python 3.10, the Python of a ZeroGPU Space). A forward takes
    **kwargs too, so the other name is swallowed without an error and the cache stays empty: hence read from the
    signature, once per model, not guessed from the version."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def make_cache(model, capacity: int) -> PreallocatedCache | RecordingDynamicCache:
    config = model.config
    if has_sliding_layers(config):
        return RecordingDynamicCache(config, capacity)
    return PreallocatedCache(config.get_text_config(decoder=True).num_hidden_layers, capacity)
