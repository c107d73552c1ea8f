"""T5 on paged attention: a transformers ``T5ForConditionalGeneration`` whose every attention runs on this library.

:class:`PagedT5` wraps the model as it is (no monkey-patching, no copy of the weights). It runs the encoder and the
decoder layer by layer itself, calling the model's own modules for everything but attention (embeddings, the RMS
layer norms, the q/k/v/o projections, the feed-forward blocks, the LM head), and this library for attention:

* encoder self-attention: :func:`~cupy_paged_attn.prefill.paged_prefill_attention`, ``causal=False``, over the
  ragged, unpadded inputs, with the bidirectional :class:`~cupy_paged_attn.RelativePositionBias` of the encoder's
  first layer (T5 computes the bias there and shares it with every layer);
* decoder self-attention: :func:`~cupy_paged_attn.paged_attention` over a paged KV cache, one new token per
  sequence per step (the decoder start token first), with the causal (``bidirectional=False``) bias of the
  decoder's first layer;
* cross-attention: :func:`~cupy_paged_attn.paged_attention` over the encoder's keys and values, written into pages
  once per input, no bias, ``seq_lens`` = the input lengths.

T5 does not scale ``<q, k>``: every call passes ``scale=1.0``. A padded HF batch (``attention_mask``) becomes ragged
lengths here: padded keys are simply not there, which equals HF's additive mask (its ``finfo.min`` gives an exact
zero after softmax).

How a model author would use it
-------------------------------
::

    import torch
    from transformers import T5ForConditionalGeneration
    from cupy_paged_attn.t5 import PagedT5

    model = T5ForConditionalGeneration.from_pretrained("google-t5/t5-small").to("cuda").eval()
    paged = PagedT5(model, num_blocks=1024, block_size=16)   # owns the page pools and the KV caches
    result = paged.generate(batch.input_ids, batch.attention_mask, max_new_tokens=32)
    result.tokens    # [num_seqs, n] int64: what model.generate(..., do_sample=False, num_beams=1)[:, 1:] gives
    result.logits    # [num_seqs, n, vocab_size] float32, the logits of each step

    # inputs may also be ragged: a list of 1-D token-id tensors, no padding at all
    result = paged.generate([ids_a, ids_b, ids_c], max_new_tokens=32)

Greedy decoding stops like transformers' (a sequence that emitted EOS continues with the pad token; generation ends
when all have, or after ``max_new_tokens``). :meth:`PagedT5.score` teacher-forces given decoder tokens and returns
the logits of each step. CUDA models run the GPU kernels on torch's current stream; CPU models run the same code
through the library's NumPy path (float64 reference math, cast to the model's dtype), useful for tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import _interop
from .bias import RelativePositionBias
from .cache import reshape_and_cache
from .decode import paged_attention
from .prefill import paged_prefill_attention

__all__ = ["PagedT5", "T5Generation"]

_UNUSED_PAGE = 0  # block-table entries past a sequence's pages: never read (any valid id would do)


@dataclasses.dataclass(frozen=True)
class T5Generation:
    """The result of :meth:`PagedT5.generate`.

    Attributes
    ----------
    tokens : torch.Tensor ``[num_seqs, n]``, int64
        The generated tokens, without the decoder start token; ``n <= max_new_tokens`` (fewer when every sequence
        reached EOS first, as in transformers).
    logits : torch.Tensor ``[num_seqs, n, vocab_size]``, float32
        The LM head's output at each step, before the argmax.
    """

    tokens: torch.Tensor
    logits: torch.Tensor


class _Pages:
    """A pool of ``num_blocks`` page ids handed out and taken back (a free list)."""

    def __init__(self, num_blocks: int, name: str) -> None:
        self._free = list(range(num_blocks - 1, -1, -1))
        self._name = name

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(
                f"{self._name}: out of pages: {count} needed, {len(self._free)} free; build PagedT5 with a larger "
                "num_blocks"
            )
        return [self._free.pop() for _ in range(count)]

    def give_back(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))


@dataclasses.dataclass
class _Batch:
    """The state of one batch: its encoder pages (cross-attention K/V) and its decoder pages (self-attention K/V)."""

    source_lens: torch.Tensor  # [num_seqs] int32: input tokens per sequence
    source_tables: torch.Tensor  # [num_seqs, max_source_blocks] int32
    source_pages: list[int]
    target_tables: torch.Tensor  # [num_seqs, max_target_blocks] int32, filled a column at a time
    target_pages: list[int]


def _host_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor, sharing its memory (bfloat16 as ml_dtypes' bfloat16)."""
    return _interop.to_array_module("tensor", t)[0]


def _clamp_fp16(h: torch.Tensor) -> torch.Tensor:
    """transformers' ``T5Block`` clamp of float16 activations (a no-op for other dtypes)."""
    if h.dtype != torch.float16:
        return h
    big = torch.finfo(h.dtype).max
    limit = torch.where(torch.isinf(h).any(), big - 1000, big)
    return torch.clamp(h, min=-limit, max=limit)


class PagedT5:
    """Greedy generation with a transformers T5 model, every attention on this library's paged kernels.

    Parameters
    ----------
    model : transformers ``T5ForConditionalGeneration``
        In eval mode, on one CUDA device (GPU kernels) or on the CPU (NumPy path); float32, bfloat16 or float16
        (float32 on the CPU for exact agreement with transformers; bfloat16 works there too). ``d_kv`` must be a
        head size the kernels support (T5: 64). Used as it is: nothing is copied or patched.
    num_blocks : int
        Pages in each of the two pools: the source pool (the encoder's keys and values, kept for cross-attention)
        and the target pool (the decoder's self-attention cache). A batch needs ``sum(ceil(len / block_size))``
        source pages and ``num_seqs * ceil(max_new_tokens / block_size)`` target pages.
    block_size : int
        Tokens per page, a power of two up to 256.

    Attributes
    ----------
    cross_caches : list of (key_cache, value_cache)
        One pair per decoder layer: the encoder output's keys and values for cross-attention, in source pages; each
        ``[num_blocks, block_size, num_heads, d_kv]`` in the model's dtype and on its device (the ``"nhd"``
        layout). NumPy views of CPU tensors for a CPU model.
    self_caches : list of (key_cache, value_cache)
        One pair per decoder layer: the decoder's self-attention cache, in target pages; same shapes.
    encoder_scratch : (key_cache, value_cache)
        The encoder layers' keys and values, in source pages; one pair shared by all encoder layers (each layer's
        are used once, right away); same shapes.
    eos_token_ids : list of int
        Read from the model's generation config (else its config) at construction, as ``generate`` reads them;
        likewise ``pad_token_id`` (what finished sequences continue with) and ``decoder_start_token_id``.

    Notes
    -----
    The relative-position tables are read from the model once, at construction (``RelativePositionBias`` uploads
    its bucket table then). Rebuild the wrapper if the weights change place or dtype.
    """

    def __init__(self, model: Any, *, num_blocks: int = 256, block_size: int = 16) -> None:
        config = getattr(model, "config", None)
        if not all(hasattr(model, a) for a in ("encoder", "decoder", "lm_head")) or not hasattr(
            config, "relative_attention_num_buckets"
        ):
            raise TypeError(f"model: expected a transformers T5ForConditionalGeneration, got {type(model).__name__}")
        if model.training:
            raise ValueError("model: expected eval mode (call model.eval() first): dropout would differ")
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected an int >= 1, got {num_blocks}")
        if block_size < 1 or block_size & (block_size - 1) or block_size > 256:
            raise ValueError(f"block_size: expected a power of two from 1 to 256, got {block_size}")
        self.model = model
        self.block_size = block_size
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self._cpu = self.device.type == "cpu"
        self._heads, self._d_kv = config.num_heads, config.d_kv
        # transformers 5 names it scale_decoder_outputs; 4.x scales whenever the embeddings are tied.
        self._scale_output = bool(getattr(config, "scale_decoder_outputs", config.tie_word_embeddings))

        shape = (num_blocks, block_size, self._heads, self._d_kv)

        def zeros() -> Any:
            return self._lib(torch.zeros(shape, dtype=self.dtype, device=self.device))

        num_layers = len(model.decoder.block)
        self.cross_caches = [(zeros(), zeros()) for _ in range(num_layers)]
        self.self_caches = [(zeros(), zeros()) for _ in range(num_layers)]
        self.encoder_scratch = (zeros(), zeros())
        self._source_pool = _Pages(num_blocks, "source pages")
        self._target_pool = _Pages(num_blocks, "target pages")

        geometry = {"num_buckets": config.relative_attention_num_buckets,
                    "max_distance": config.relative_attention_max_distance}
        enc_table = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        dec_table = model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        self._encoder_bias = RelativePositionBias(self._lib(enc_table), bidirectional=True, **geometry)
        self._decoder_bias = RelativePositionBias(self._lib(dec_table), bidirectional=False, **geometry)

        # The special tokens as generate() reads them: the generation config first, then the model config.
        gen = getattr(model, "generation_config", None) or config

        def token(name: str) -> Any:
            value = getattr(gen, name, None)
            return value if value is not None else getattr(config, name, None)

        eos = token("eos_token_id")
        self.eos_token_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        pad = token("pad_token_id")
        self.pad_token_id = int(pad) if pad is not None else (self.eos_token_ids or [0])[0]
        start = token("decoder_start_token_id")
        self.decoder_start_token_id = int(start) if start is not None else self.pad_token_id

    # ------------------------------------------------------------------ the boundary with the library
    def _lib(self, t: torch.Tensor) -> Any:
        """What the library gets: the tensor itself on a GPU, a NumPy view of it on the CPU."""
        return _host_view(t) if self._cpu else t.detach()

    def _torch(self, a: Any) -> torch.Tensor:
        """A library result back as a tensor of the model's dtype."""
        return _interop.torch_from_numpy(a).to(self.dtype) if self._cpu else a

    def _heads_of(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, num_heads * d_kv]`` → ``[tokens, num_heads, d_kv]`` (a view)."""
        return x.view(x.shape[0], self._heads, self._d_kv)

    # ------------------------------------------------------------------ batches and pages
    def _sequences(self, input_ids: Any, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
        """The unpadded token ids of each input, from a padded batch (+ mask) or a list of 1-D tensors."""
        if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2:
            if attention_mask is None:
                return list(input_ids)
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask: expected shape {tuple(input_ids.shape)} (input_ids'), "
                    f"got {tuple(attention_mask.shape)}"
                )
            rows = []
            for s, (ids, mask) in enumerate(zip(input_ids, attention_mask.bool(), strict=True)):
                kept = mask.nonzero().flatten()
                if len(kept) and int(kept[-1] - kept[0]) + 1 != len(kept):
                    raise ValueError(f"attention_mask: row {s} is not one contiguous run of ones (left or right "
                                     "padding only)")
                rows.append(ids[kept])
            return rows
        if attention_mask is not None:
            raise ValueError("attention_mask: only with a padded input_ids [num_seqs, max_len]")
        rows = [torch.as_tensor(ids) for ids in input_ids]
        for s, ids in enumerate(rows):
            if ids.ndim != 1:
                raise ValueError(f"input_ids[{s}]: expected a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
        return rows

    def _open_batch(self, lens: list[int], steps: int) -> _Batch:
        bs = self.block_size
        counts = [-(-n // bs) for n in lens]
        pages = self._source_pool.take(sum(counts))
        table = np.full((len(lens), max(counts, default=0) or 1), _UNUSED_PAGE, dtype=np.int32)
        first = 0
        for s, c in enumerate(counts):
            table[s, :c] = pages[first:first + c]
            first += c
        target_width = max(1, -(-steps // bs))
        return _Batch(
            source_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            source_tables=torch.from_numpy(table).to(self.device),
            source_pages=pages,
            target_tables=torch.full((len(lens), target_width), _UNUSED_PAGE, dtype=torch.int32, device=self.device),
            target_pages=[],
        )

    def _close_batch(self, batch: _Batch) -> None:
        self._source_pool.give_back(batch.source_pages)
        self._target_pool.give_back(batch.target_pages)

    def _source_slots(self, batch: _Batch, lens: list[int]) -> torch.Tensor:
        """``[total_tokens]`` int64: the cache slot of every input token, sequence after sequence."""
        tables = batch.source_tables.to(torch.int64)
        slots = [tables[s, torch.arange(n, device=self.device) // self.block_size] * self.block_size
                 + torch.arange(n, device=self.device) % self.block_size for s, n in enumerate(lens)]
        return torch.cat(slots)

    # ------------------------------------------------------------------ the two stacks
    def _encode(self, ids: list[torch.Tensor], batch: _Batch) -> None:
        """Run the encoder on the packed inputs; write each decoder layer's cross-attention K/V into pages."""
        lens = [len(x) for x in ids]
        starts = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=self.device)
        slots = self._source_slots(batch, lens)
        lib_slots, lib_lens, lib_tables, lib_starts = (
            self._lib(slots), self._lib(batch.source_lens), self._lib(batch.source_tables), self._lib(starts)
        )
        encoder = self.model.encoder
        h = encoder.embed_tokens(torch.cat(ids).to(self.device))  # [total_tokens, d_model]
        key_cache, value_cache = self.encoder_scratch
        for block in encoder.block:
            layer = block.layer[0]
            attn = layer.SelfAttention
            x = layer.layer_norm(h)
            q, k, v = (self._heads_of(proj(x)) for proj in (attn.q, attn.k, attn.v))
            reshape_and_cache(self._lib(k), self._lib(v), key_cache, value_cache, lib_slots)
            a = paged_prefill_attention(
                self._lib(q), key_cache, value_cache, lib_tables, lib_lens, lib_starts,
                causal=False, scale=1.0, attn_bias=self._encoder_bias,
            )
            h = _clamp_fp16(h + attn.o(self._torch(a).reshape(h.shape[0], -1)))
            h = _clamp_fp16(block.layer[-1](h))  # T5LayerFF: layer norm, feed-forward, residual
        h = encoder.final_layer_norm(h)
        for block, (k_cache, v_cache) in zip(self.model.decoder.block, self.cross_caches, strict=True):
            cross = block.layer[1].EncDecAttention
            reshape_and_cache(self._lib(self._heads_of(cross.k(h))), self._lib(self._heads_of(cross.v(h))),
                              k_cache, v_cache, lib_slots)

    def _decode_step(self, tokens: torch.Tensor, step: int, batch: _Batch) -> torch.Tensor:
        """One decoder step: ``tokens [num_seqs]`` at position ``step`` → logits ``[num_seqs, vocab]`` float32."""
        bs = self.block_size
        if step % bs == 0:  # every sequence enters a new page
            pages = self._target_pool.take(len(tokens))
            batch.target_pages += pages
            batch.target_tables[:, step // bs] = torch.tensor(pages, dtype=torch.int32, device=self.device)
        slots = batch.target_tables[:, step // bs].to(torch.int64) * bs + step % bs
        target_lens = torch.full((len(tokens),), step + 1, dtype=torch.int32, device=self.device)
        lib_slots, lib_target_lens = self._lib(slots), self._lib(target_lens)
        lib_target_tables = self._lib(batch.target_tables)
        lib_source_tables, lib_source_lens = self._lib(batch.source_tables), self._lib(batch.source_lens)

        decoder = self.model.decoder
        h = decoder.embed_tokens(tokens)  # [num_seqs, d_model]
        for block, (k_cache, v_cache), (xk_cache, xv_cache) in zip(
            decoder.block, self.self_caches, self.cross_caches, strict=True
        ):
            layer = block.layer[0]
            attn = layer.SelfAttention
            x = layer.layer_norm(h)
            q, k, v = (self._heads_of(proj(x)) for proj in (attn.q, attn.k, attn.v))
            reshape_and_cache(self._lib(k), self._lib(v), k_cache, v_cache, lib_slots)
            a = paged_attention(self._lib(q), k_cache, v_cache, lib_target_tables, lib_target_lens, scale=1.0,
                                attn_bias=self._decoder_bias)
            h = _clamp_fp16(h + attn.o(self._torch(a).reshape(h.shape[0], -1)))

            layer = block.layer[1]
            cross = layer.EncDecAttention
            q = self._heads_of(cross.q(layer.layer_norm(h)))
            a = paged_attention(self._lib(q), xk_cache, xv_cache, lib_source_tables, lib_source_lens, scale=1.0)
            h = _clamp_fp16(h + cross.o(self._torch(a).reshape(h.shape[0], -1)))
            h = _clamp_fp16(block.layer[-1](h))
        h = decoder.final_layer_norm(h)
        if self._scale_output:
            h = h * self.model.model_dim**-0.5
        return self.model.lm_head(h).float()

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(
        self, input_ids: Any, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int = 32
    ) -> T5Generation:
        """Greedy generation, as ``model.generate(..., do_sample=False, num_beams=1, max_new_tokens=...)``.

        Parameters
        ----------
        input_ids : torch.Tensor ``[num_seqs, max_len]`` int64, or a list of 1-D int64 tensors ``[len_s]``
            A padded batch (with ``attention_mask``) or ragged inputs. Every input needs at least one token.
        attention_mask : torch.Tensor ``[num_seqs, max_len]``, optional
            1 for real tokens, 0 for padding (left or right); only with a padded ``input_ids``.
        max_new_tokens : int
            Tokens to generate per sequence (fewer when every sequence reaches EOS first).

        Returns
        -------
        T5Generation
            ``tokens [num_seqs, n]`` int64 and ``logits [num_seqs, n, vocab_size]`` float32, on the model's device.
        """
        return self._run(self._sequences(input_ids, attention_mask), max_new_tokens, forced=None)

    @torch.no_grad()
    def score(self, input_ids: Any, attention_mask: torch.Tensor | None, decoder_tokens: torch.Tensor) -> torch.Tensor:
        """The logits of each step with the decoder fed ``decoder_tokens`` (teacher forcing), step by step.

        Parameters
        ----------
        input_ids, attention_mask
            As in :meth:`generate`.
        decoder_tokens : torch.Tensor ``[num_seqs, n]`` int64
            The tokens to feed after the decoder start token (e.g. a generation's tokens, start token excluded).

        Returns
        -------
        torch.Tensor ``[num_seqs, n, vocab_size]`` float32
            Row ``i`` holds the logits given the start token and ``decoder_tokens[:, :i]``.
        """
        return self._run(self._sequences(input_ids, attention_mask), decoder_tokens.shape[1],
                         forced=decoder_tokens.to(self.device)).logits

    def _run(self, ids: list[torch.Tensor], steps: int, forced: torch.Tensor | None) -> T5Generation:
        lens = [len(x) for x in ids]
        if not lens or min(lens) == 0:
            raise ValueError(f"input_ids: expected at least one sequence of >= 1 token each, got lengths {lens}")
        if steps < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {steps}")
        if forced is not None and forced.shape[0] != len(lens):
            raise ValueError(f"decoder_tokens: expected {len(lens)} rows (one per input), got {forced.shape[0]}")
        num_seqs = len(lens)
        batch = self._open_batch(lens, steps)
        try:
            self._encode(ids, batch)
            token = torch.full((num_seqs,), self.decoder_start_token_id, dtype=torch.int64, device=self.device)
            eos = torch.tensor(self.eos_token_ids, dtype=torch.int64, device=self.device)
            unfinished = torch.ones(num_seqs, dtype=torch.bool, device=self.device)
            tokens, logits = [], []
            for step in range(steps):
                step_logits = self._decode_step(token, step, batch)
                logits.append(step_logits)
                if forced is not None:
                    token = forced[:, step]
                else:  # greedy, finished sequences continue with padding (transformers' rule)
                    token = torch.where(unfinished, step_logits.argmax(-1), self.pad_token_id)
                    unfinished &= ~torch.isin(token, eos)
                tokens.append(token)
                if forced is None and len(eos) and not bool(unfinished.any()):
                    break
        finally:
            self._close_batch(batch)
        return T5Generation(torch.stack(tokens, dim=1), torch.stack(logits, dim=1))
