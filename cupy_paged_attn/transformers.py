"""transformers' continuous batching on this library's kernels: one line, ``enable(model)``.

transformers (5.x) runs continuous batching (``model.generate_batch``, ``ContinuousBatchingManager``) over its own
paged KV cache, and calls the model's attention function with the batch packed into one row of ragged sequences.
:func:`enable` registers :func:`attention_forward` under the name :data:`NAME` in transformers'
``AttentionInterface`` and makes it the model's attention implementation, so every attention layer runs here::

    import cupy_paged_attn.transformers

    model = cupy_paged_attn.transformers.enable(AutoModelForCausalLM.from_pretrained(...))
    outputs = model.generate_batch(inputs=prompts, generation_config=generation_config)

CUDA models run the GPU kernels on torch's current stream (no host synchronisation, launch shapes from Python
ints only, outputs allocated by torch: continuous batching's CUDA graphs capture them); CPU models run the library's
NumPy path (float64 reference math), useful for tests.

The two calls continuous batching makes
---------------------------------------
* **Packed K/V** (prefill, mixed batches, and decode): transformers writes the new keys and values into its cache,
  then gathers each sequence's keys and values (past and new) into one packed tensor (``index_select``: a copy it
  makes before calling us) and passes ``cu_seq_lens_q`` / ``cu_seq_lens_k``. We view the packed keys as pages of
  one token, build each sequence's block table from ``cu_seq_lens_k`` on the device (int32
  ``[num_seqs + 1, max(max_length_k, num_tokens)]``: small next to the keys, but it grows with the longest
  sequence) and run
  :func:`~cupy_paged_attn.torch.paged_prefill_attention`, causal. No copy of ours: the packed tensors are used as
  they come. This is not reading the cache in place; transformers' gather is the copy. A batch of decode steps
  only (``max_length_q == 1``: each sequence has one query row, as in a batch transformers does not pad) runs
  :func:`~cupy_paged_attn.torch.paged_attention` over the same pages instead: the decode kernels, which need no
  query tile of their own per sequence.
* **Block tables** (decode): transformers passes its cache's pages themselves (``k_cache`` / ``v_cache``
  ``[num_pages, page_size, num_kv_heads, head_size]``, this library's ``"nhd"`` layout) with a ``block_table``, and
  leaves writing the new token to the attention function: we write it with
  :func:`~cupy_paged_attn.torch.reshape_and_cache` and run :func:`~cupy_paged_attn.torch.paged_attention` on the
  cache in place. Zero-copy. transformers offers this call only to FlashAttention 2/3 on CUDA (and for full
  attention only), so with :func:`enable` it does not come; reading the cache in place for every batch would need
  transformers to pass block tables for prefill and mixed batches too, which it does for no implementation.
  :func:`attention_forward` handles the call all the same (tested directly), ready for when transformers offers it.

What is mapped
--------------
``scaling`` → ``scale``; ``sliding_window=w`` (a query attends its last ``w`` keys, itself included, as in
transformers' masks and FlashAttention's ``window_size=(w - 1, w - 1)``) → ``window_left=w - 1``; ``softcap=c``
→ ``logits_soft_cap=c`` (Gemma 2). Grouped-query attention as it comes (``num_kv_heads`` dividing ``num_heads``).
Refused: attention sinks (``s_aux``), attention dropout, multi-head latent attention caches, head sizes the kernels
lack (see :func:`enable`). Query rows past ``cu_seq_lens_q[-1]`` (transformers' padding of a batch to a graph
size) are run as one more sequence over the padded keys, causal, and their output is not read: a cost of the
padding's size squared.

Outside continuous batching
---------------------------
A call without ``cu_seq_lens_q`` (``model.generate``, a plain forward with a regular cache) goes to transformers'
own ``sdpa_attention_forward``, with the masks transformers builds for ``"sdpa"`` (:func:`enable` registers
``sdpa_mask`` for :data:`NAME`): the model keeps working, with torch's attention there. A soft-capped model
(Gemma 2) cannot go there (SDPA has no soft-cap): that call raises ``ValueError`` and says to use
``generate_batch``.

Why the name contains "flash"
-----------------------------
Continuous batching accepts ``"sdpa"``, ``"paged|eager"`` or a name containing ``"flash"``, and only the last
passes no attention mask (the packed sequences are described by ``cu_seq_lens`` alone, as here). :data:`NAME`
has no ``2`` or ``3`` after "flash", so transformers does not take it for FlashAttention 2/3 and look for that
package. ``set_attn_implementation`` would look for it all the same, so :func:`enable` sets the model's
``config._attn_implementation`` (a property that sets every sub-config too) directly.
"""

from __future__ import annotations

from typing import Any

try:
    import torch
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as error:  # transformers missing, or a 4.x without these names
    raise ImportError(
        "cupy_paged_attn.transformers needs torch and transformers >= 5.24 (continuous batching with "
        f"AttentionInterface): {error}"
    ) from error

from . import _specs
from . import torch as _ops

__all__ = ["NAME", "attention_forward", "enable"]

#: The first transformers release whose continuous batching calls the attention function as this module expects
#: (the cache written and each layer's cu_seq_lens_k picked before the call; no "paged|" prefix). Tested on 5.24 and
#: 5.25; 5.23 and 5.19 give wrong tokens with this module, 5.17 passes the cache object to a "paged|" implementation.
_MIN_TRANSFORMERS = "5.24"


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


if _release(transformers.__version__) < _release(_MIN_TRANSFORMERS):
    raise ImportError(
        f"cupy_paged_attn.transformers needs transformers >= {_MIN_TRANSFORMERS} (continuous batching that calls the "
        f"attention function with the cache written), got {transformers.__version__}"
    )

NAME = "flash_cupy_paged"
"""The attention implementation's name in transformers' ``AttentionInterface`` (see the module docstring: why
"flash")."""


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention of one layer, as transformers' ``AttentionInterface`` calls it.

    Parameters
    ----------
    module : torch.nn.Module
        The model's attention module (unused).
    query : Tensor ``[1, num_heads, num_tokens, head_size]``
        Continuous batching packs all sequences' query rows into one row, in its scheduler's order.
    key, value : Tensor ``[1, num_kv_heads, num_keys, head_size]``
        Packed keys: each sequence's past and new keys, ``cu_seq_lens_k`` apart; with ``block_table``, the new
        token of each sequence only (``num_keys`` = ``num_tokens``).
    attention_mask : None
        Continuous batching passes none (the sequences are ``cu_seq_lens`` apart). Outside it, a mask as
        transformers builds for ``"sdpa"``.
    dropout : float
        Must be 0.
    scaling : float, optional
        The logit scale; default ``1 / sqrt(head_size)``.
    **kwargs
        ``cu_seq_lens_q`` (int32 ``[num_seqs + 1]``), ``cu_seq_lens_k`` (int32 ``[num_seqs + 1]``: the keys of each
        sequence, the new ones included), ``max_length_k`` (int); ``block_table`` (int32
        ``[num_seqs, max_blocks]``, -1 unused), ``k_cache`` and ``v_cache`` (``[num_pages, page_size, num_kv_heads,
        head_size]``) for the block-table call; ``sliding_window`` (int), ``softcap`` (float) when the model has
        them. Trailing sequences of zero length (padding) are allowed in both calls.

    Returns
    -------
    (Tensor ``[1, num_tokens, num_heads, head_size]``, None)
        The output, of the query's dtype, and no attention weights.

    Raises
    ------
    NotImplementedError
        ``s_aux`` (attention sinks) or ``dropout > 0``.
    ValueError
        A soft-capped model called outside continuous batching.
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"s_aux: attention sinks are not supported by {NAME}")
    if dropout:
        raise NotImplementedError(f"dropout: expected 0 (inference kernels), got {dropout}")
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")
    window_left = None if window is None else int(window) - 1
    if kwargs.get("cu_seq_lens_q") is None:
        if softcap is not None:
            raise ValueError(
                f"softcap: {NAME} runs soft-capped attention in continuous batching only (model.generate_batch); "
                "outside it, calls go to torch's SDPA, which has no soft-cap: load the model with "
                'attn_implementation="eager" for model.generate'
            )
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    options = {"scale": scaling, "logits_soft_cap": softcap, "window_left": window_left}
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_size]: contiguous as the model's view gives it
    if kwargs.get("block_table") is not None:
        out = _decode_in_cache(q, key, value, kwargs, options)
    elif kwargs.get("max_length_q") == 1:
        out = _packed_decode(q, key, value, kwargs, options)
    else:
        out = _packed_prefill(q, key, value, kwargs, options)
    return out.unsqueeze(0), None


def _packed_prefill(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any],
                    options: dict[str, Any]) -> torch.Tensor:
    """The packed call: keys ``[1, num_kv_heads, num_keys, head_size]`` viewed as ``num_keys`` pages of one token.

    Query rows past ``cu_seq_lens_q[-1]`` (transformers pads a batch to the size of a CUDA graph) become one more
    sequence, as many keys long as it has rows, so that ``query_start_loc`` ends at ``num_tokens`` as the library
    requires; its output is never read.
    """
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = kwargs["cu_seq_lens_k"].to(torch.int32)
    total_q = q.shape[0]
    k, v, block_tables = _packed_pages(key, value, cu_k, max(int(kwargs["max_length_k"]), total_q, 1))
    query_start_loc = torch.cat([cu_q, cu_q.new_full((1,), total_q)])
    seq_lens = torch.cat([cu_k[1:] - cu_k[:-1], total_q - cu_q[-1:]])
    return _ops.paged_prefill_attention(q, k, v, block_tables, seq_lens, query_start_loc, causal=True, **options)


def _packed_decode(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any],
                   options: dict[str, Any]) -> torch.Tensor:
    """The packed call with ``max_length_q == 1``: sequence s's query row (if it has one) is row ``cu_seq_lens_q[s]``,
    the last of its keys, so its causal attention is decode over all of them. The rows are gathered, decoded over the
    keys viewed as pages of one token, and put back; a sequence without a row (length-0 padding) gets length 0 and
    writes a spare row."""
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = kwargs["cu_seq_lens_k"].to(torch.int32)
    total_q = q.shape[0]
    k, v, block_tables = _packed_pages(key, value, cu_k[:-1], max(int(kwargs["max_length_k"]), 1))
    has_row = cu_q[1:] > cu_q[:-1]
    rows = torch.where(has_row, cu_q[:-1], total_q).long()  # total_q: the spare row
    seq_lens = torch.where(has_row, cu_k[1:] - cu_k[:-1], 0)
    padded = torch.cat([q, q.new_zeros((1, *q.shape[1:]))])
    out = torch.zeros_like(padded)
    out.index_copy_(0, rows, _ops.paged_attention(padded[rows], k, v, block_tables, seq_lens, **options))
    return out[:total_q]


def _packed_pages(key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor,
                  width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed keys and values ``[1, num_kv_heads, num_keys, head_size]`` as ``num_keys`` pages of one token, and a
    block table of ``width`` columns whose row s is ``starts[s], starts[s] + 1, ...`` (sequence s's j-th key is page
    ``starts[s] + j``). The clamp keeps entries past a sequence's length valid page ids (never read). ``width``
    comes from Python ints (transformers pads max_length_k for CUDA graphs) and shapes: no value is read on the
    host."""
    # transformers' gather gives [num_keys, num_kv_heads, head_size] rows, transposed back: contiguous() is free
    k = key[0].transpose(0, 1).contiguous().unsqueeze(1)
    v = value[0].transpose(0, 1).contiguous().unsqueeze(1)
    columns = torch.arange(width, dtype=torch.int32, device=starts.device)
    block_tables = (starts[:, None] + columns).clamp_(max=max(k.shape[0] - 1, 0))
    return k, v, block_tables


def _decode_in_cache(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any],
                     options: dict[str, Any]) -> torch.Tensor:
    """The block-table call: write each sequence's new token into the pages, then decode on them in place."""
    block_tables = kwargs["block_table"].to(torch.int32)
    k_cache, v_cache = kwargs["k_cache"], kwargs["v_cache"]
    num_seqs, page_size = block_tables.shape[0], k_cache.shape[1]
    cu_k = kwargs["cu_seq_lens_k"].to(torch.int32)[: num_seqs + 1]
    seq_lens = cu_k[1:] - cu_k[:-1]  # the new token included; 0 for a padded sequence
    position = (seq_lens - 1).clamp(min=0).long()  # where the new token goes
    page = block_tables.long().gather(1, (position // page_size).unsqueeze(1)).squeeze(1)
    slots = torch.where(seq_lens > 0, page * page_size + position % page_size, -1)  # -1: not written
    new_k = key[0].transpose(0, 1)[:num_seqs].contiguous()  # [num_seqs, num_kv_heads, head_size]
    new_v = value[0].transpose(0, 1)[:num_seqs].contiguous()
    _ops.reshape_and_cache(new_k, new_v, k_cache, v_cache, slots)
    out = _ops.paged_attention(q[:num_seqs].contiguous(), k_cache, v_cache, block_tables, seq_lens, **options)
    if out.shape[0] < q.shape[0]:  # query rows past the block table's (padding): zeros
        out = torch.cat([out, out.new_zeros((q.shape[0] - num_seqs, *out.shape[1:]))])
    return out


def _register() -> None:
    """Register :func:`attention_forward` and SDPA's mask builder under :data:`NAME` (idempotent)."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def _check_model(model: Any) -> None:
    """Refuse a model whose attention this module cannot run, naming what is unsupported."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"model: {type(model).__name__} does not dispatch its attention through transformers' "
            "AttentionInterface (_supports_attention_backend is False)"
        )
    text = config.get_text_config()
    if getattr(text, "kv_lora_rank", None) is not None:
        raise NotImplementedError(
            f"model: multi-head latent attention (kv_lora_rank={text.kv_lora_rank}) keeps compressed latents in the "
            "cache, not keys and values"
        )
    head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if head_size not in _specs.HEAD_SIZES:
        raise NotImplementedError(
            f"model: head_size {head_size} is not supported; supported: {', '.join(map(str, _specs.HEAD_SIZES))}"
        )
    sinks = [name for name, sub in model.named_modules() if isinstance(getattr(sub, "sinks", None), torch.Tensor)]
    if sinks:
        raise NotImplementedError(f"model: attention sinks (s_aux, in {sinks[0]}) are not supported")
    attention_dropout = getattr(text, "attention_dropout", 0.0) or 0.0
    if model.training and attention_dropout > 0:
        raise NotImplementedError(
            f"model: attention dropout {attention_dropout} in training mode is not supported; call model.eval()"
        )


def enable(model: Any) -> Any:
    """Run ``model``'s attention on this library, in continuous batching and out of it.

    Parameters
    ----------
    model : transformers ``PreTrainedModel``
        A model that dispatches its attention through ``AttentionInterface`` (Llama, Qwen2, Mistral, Gemma 2 and
        most decoders), with a supported head size (32, 64, 80, 96, 112, 120, 128, 192 or 256), on a CUDA device
        (GPU kernels) or on the CPU (NumPy path). Changed in place: its config's ``_attn_implementation`` becomes
        :data:`NAME` (sub-configs included).

    Returns
    -------
    model
        The same model, for ``model = enable(AutoModelForCausalLM.from_pretrained(...))``.

    Raises
    ------
    TypeError
        ``model`` is not a transformers model.
    NotImplementedError
        Attention outside ``AttentionInterface``, multi-head latent attention (``kv_lora_rank``), an unsupported
        head size, attention sinks (``s_aux``), or attention dropout in training mode.
    """
    _check_model(model)
    _register()
    model.config._attn_implementation = NAME
    return model
