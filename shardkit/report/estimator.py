"""A pre-compile estimate of one training step per device: memory at its peak, wire bytes.

:func:`estimate` predicts, without XLA, what :func:`shardkit.report.build_report` measures in
the compiled program: each device's arguments (the stored state and the token batch),
its temp memory at the peak, their total, and the wire bytes by collective kind. It
takes a plan (or a recipe and a mesh) and a model's :class:`~shardkit.dims.ModelDims`
(or a model that declares them), and runs in about a millisecond.

The temp memory is the peak of the step's phases, each a sum of the report's itemised
terms (:data:`shardkit.report.memory_terms.TERMS`), from the structure of the step:

- ``gradients``: the stored gradient shard (f32), and the whole table gradient that
  waits for its reduction where the layout replicates the vocabulary table;
- ``saved activations``: what the scanned layer keeps for its backward pass, per
  remat policy (:func:`saved_values`: the layer input under ``full``; the matmul
  outputs too under ``save_dots``; every intermediate under ``none``), for every layer
  (times the work items a pipeline stage holds in flight, :func:`in_flight`; the rolled
  pipeline engine, the default, by its own buffers: :func:`_rolled_terms`);
- ``recomputation`` and ``attention scores``: the one layer whose backward runs,
  recomputed (``full``, ``save_dots``) and its gradients' working set;
- ``gathered weights``: a layer's weights gathered, and their unreduced gradient,
  where fsdp or TSP shards them;
- ``logits / loss``: the chunked head's hidden states, whole, beside the larger of their
  gradient and its f32 logits and weight buffers
  (:func:`~shardkit.report.phases.head_loss_peak_bytes`), or a pipeline's in-place
  head's (:func:`~shardkit.report.phases.head_grad_peak_bytes`).

The wire bytes are the analytic model's (:func:`~shardkit.report.analytic.analytic_costs`),
the state its ZeRO shards. The fitted constants are the :data:`FIT` table's, each named
and justified there; ``benchmarks/estimator.py`` fits them on a training grid and judges
the estimate on a held-out one.

Example:
  >>> from shardkit.dims import ModelDims
  >>> dims = ModelDims(layers=2, d_model=64, n_heads=8, n_kv_heads=8, d_ff=256,
  ...                  vocab=256, max_seq=128, tied_embedding=True, position_table=True,
  ...                  biases=True, norm="layernorm", chunked_head=True)
  >>> e = estimate("fsdp", dims, mesh={"fsdp": 8}, batch=8, seq=128, remat="full")
  >>> e.phase in ("layers", "head_loss", "optimizer_step"), e.total > e.arguments > 0
  (True, True)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import re
import time
import warnings
from collections.abc import Mapping
from typing import Any

from shardkit import recipes
from shardkit.dims import ModelDims
from shardkit.errors import ShardingError
from shardkit.nn.loss import LOGITS, auto_chunks
from shardkit.parallel.schedules import SPLIT, make
from shardkit.report import analytic_moe
from shardkit.report.analytic import analytic_costs, workload_of
from shardkit.report.phases import (
    head_grad_peak_bytes,
    head_loss_peak_bytes,
    head_table_splits,
    head_weight_copy_bytes,
    spec_split,
)
from shardkit.report.pipeline_analytic import chunks_a_stage, in_flight
from shardkit.step import PIPELINE_DEFAULTS

__all__ = ["FIT", "Estimate", "against", "estimate", "estimate_or_refusal", "saved_values"]


def _xla_release() -> tuple[int, ...] | None:
    """The installed jaxlib's release (XLA's package; jax's where it is missing) as
    numbers, ``(0, 12, 0, 1)`` for 0.12.0.1, read off the packages' metadata, not by
    importing jax; ``None`` where neither is installed (an estimate for elsewhere)."""
    for package in ("jaxlib", "jax"):
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        release = re.match(r"\d+(?:\.\d+)*", version)
        if release:
            return tuple(int(n) for n in release[0].split("."))
    return None


def _bf16_matmul_bytes() -> float:
    """What XLA:CPU keeps of a bf16 matmul output, by the installed jaxlib: 2 from 0.12,
    4 before (see ``FIT["bf16_matmul_bytes"]``); neither installed, the current
    release's 2."""
    release = _xla_release()
    return 2.0 if release is None or release[:2] >= (0, 12) else 4.0


def _score_buffers() -> float:
    """Score-sized values (a query's row of scores over the keys, per head) the
    attention's backward holds, by the installed jaxlib: the scores and their softmax,
    two, up to 0.12.0; one from 0.12.1, whose XLA:CPU holds one f32[b, a, s, s] where
    0.12.0.1 held two (gpt-tiny on the rolled engine's stages and llama-tiny on fsdp,
    counted in both releases' buffers); neither installed, 0.12.0.1's two (the release
    the constants are fitted on)."""
    release = _xla_release()
    return 1.0 if release is not None and release[:3] >= (0, 12, 1) else 2.0


_BF16_MATMUL_BYTES = _bf16_matmul_bytes()
_SCORE_BUFFERS = _score_buffers()

#: The constants, by name: each multiplies a structural count (1.0: the count itself) by
#: what XLA keeps live. ``benchmarks/estimator.py --fit`` fits eleven of them (its
#: ``FITTED``, within bounds) on its two training grids (up to 1,024 and from 2,048 tokens
#: a device), minimising the mean absolute log error of the totals: the three backward
#: fractions, the two backward_width_values, tensor_width_values,
#: tensor_reduction_fraction, large_rows_width_values, gathered_weight_copies, head_copies,
#: heap_fragmentation (``--fit NAMES`` fits those named, the others held); two of the
#: rolled pipeline engine's (``ROLLED_FITTED``) on its rolled training grid alone, the
#: others held: rolled_head_overlap, rolled_backward_fraction; rolled_pair_fraction on the
#: rolled engine's large training grid alone (the others held); and moe_backward_fraction
#: on the moe_tiny grid alone. The other five are counted from XLA's buffers (large_rows
#: from where it stops fusing, bf16_matmul_bytes by the installed jaxlib), and
#: rolled_remat_fraction is held. Since the gathered norms' and TSP's assembled input
#: gradients' counts (_GATHERED_NORM_VALUES, _TSP_IN_PROJECTION_VALUES),
#: backward_width_values and backward_layer_fraction are refitted alone (``--fit
#: backward_width_values,backward_layer_fraction``), the others held: refitting all ten
#: moved most of them and left the grids no better (90 / 86 / 89 / 92 % within ±10 %
#: against 90 / 84 / 89 / 94 %, moe_tiny 75 % against 92 %), the worst point at 1.30.
#: tensor_reduction_fraction, added with its moment, is fitted alone (``--fit
#: tensor_reduction_fraction``), the others held.
FIT: dict[str, float] = {
    # Copies of the layer stack's stored gradient shard live at the layers' peak, per
    # scan buffer holding it (the backward's accumulator; without remat also the
    # forward scan's output buffer).
    "gradient_copies": 1.0,
    # The backward layer's working set under remat "full" (its recomputed forward and
    # the gradients computed from it) in units of its attention's values (q/k/v, the
    # context and its transpose, the scores and their softmax: 3q + 2k + 2·a·s, one
    # a·s from jax 0.12.1, whose XLA holds one score-sized value there); the
    # width-h ones (backward_width_values), a dense MLP's (_MLP_BACKWARD_VALUES) and an
    # MoE MLP's (moe_backward_fraction) are counted apart. XLA frees and fuses part of it.
    "backward_layer_fraction": 0.811,
    # The same under "save_dots": the matmul outputs are read from the saved values,
    # not recomputed (< full's).
    "backward_save_dots_fraction": 0.638,
    # The same without remat: the forward's values are saved activations; the backward
    # holds their gradients and their layout copies (a ring attention's steps,
    # rematerialised whatever the policy, take backward_layer_fraction).
    "backward_none_fraction": 1.199,
    # Width-h values per token the backward layer holds where it recomputes its forward
    # (the residual stream, the norms' outputs, their gradients and layout copies), whole
    # under tensor parallelism without sequence parallelism.
    "backward_width_values": 7.023,
    # The same without remat: the forward's width-h values are saved activations, the
    # layer holds their gradients (counted at the peak of gpt-tiny and llama-tiny on dp
    # over 8, 320 tokens a device: 4-5 buffers one token × h wide without remat, 10 under
    # full, q and the attention's context among them under either).
    "backward_width_values_none": 2.584,
    # Tensor parallelism's further width-h values per token of the whole sequence: the
    # activation reductions' operands and results, the norms' outputs copied for the
    # split matmuls; under sequence parallelism the all-gathered sequence (without
    # remat counted instead: _SP_GATHERED_VALUES).
    "tensor_width_values": 0.729,
    # The share of the backward layer's working set (its recomputation; a recomputed
    # forward's scores are counted beside it, _REDUCED_SCORE_VALUES) live at tensor
    # parallelism's reduction of the MLP's input gradient (_REDUCED_INPUT_GRADIENT_VALUES),
    # where that reduction is the layers' peak. Fitted alone on the two training grids,
    # the others held (0.573 before _REDUCED_SCORE_VALUES and _GATED_BF16_VALUES).
    "tensor_reduction_fraction": 0.518,
    # Matmul rows per device (tokens) from which XLA:CPU materialises values it fuses
    # below: the backward's slices of the saved stack, the norms' intermediates
    # (measured on llama tp/8 without remat: 3,584 rows fuse them, 4,096 do not, at
    # any width). Counted, not fitted.
    "large_rows": 4096.0,
    # Width-h values per token (h whole) the backward layer holds from large_rows rows
    # (f32; under sequence parallelism the gathered matmul inputs, in the matmul's bytes).
    "large_rows_width_values": 2.881,
    # The share of one layer's gradient whole at the peak where fsdp (or TSP's gathers)
    # reduce-scatters it: XLA scatters each weight's gradient as soon as it is computed
    # (counted on gpt fsdp/8: the MLP's down and the attention's output projections'
    # of the layer's weights, a third).
    "scattered_layer_gradient": 0.333,
    # Copies of one layer's weights gathered by fsdp or TSP (the weights and their
    # layout copies, the next weight's prefetched gather).
    "gathered_weight_copies": 1.0,
    # Copies of the chunked head's logits and weight buffers, in units of
    # head_loss_peak_bytes' count of them (its hidden states are counted whole; a
    # pipeline's in-place head, head_grad_peak_bytes, is counted as it is).
    "head_copies": 0.838,
    # Bytes of a bf16 activation as XLA's CPU backend keeps it: its float normalisation
    # converts the bf16 values to f32 around every op (the residual stream, the norms,
    # the scores and softmax the backward recomputes: counted in its buffers as f32).
    "bf16_activation_bytes": 4.0,
    # Bytes of a bf16 matmul output and of what the scan saves under bf16 (the MLP's
    # values, q/k/v, the saved layer inputs, a ring's K/V blocks): bf16 from jax 0.12
    # (its buffers: bf16[...]); jax 0.10's XLA:CPU kept f32 copies of them too
    # (wrapped_convert f32[...]). Measured on 0.10.2 and 0.12.0.1; 0.11 counted as 0.10.
    "bf16_matmul_bytes": _BF16_MATMUL_BYTES,
    # The temp heap's unused share at its peak (XLA's heap packing), of the live bytes
    # (bounded at 5 %: free, the fit trades every term for it). Measured on the jax 0.12
    # grids: 0.9 % on average, 0.1 % the median; the fit takes its bound, which stands
    # in for what the terms miss (fixed at 1 % and the rest refitted, the four dense grids
    # are within ±10 % at 85 / 75 / 86 / 86 %, against 86 / 77 / 86 / 91 % at 5 %).
    "heap_fragmentation": 0.05,
    # The share of an MoE MLP's values (analytic_moe.mlp_values: the router's, the
    # dispatched tokens', the experts' matmuls') the backward layer holds, under any remat
    # policy; fitted on the moe_tiny grid alone, the dense constants held. One share for
    # every policy trades them: above 1, its points without remat are over (1.05-1.10).
    "moe_backward_fraction": 1.145,
    # The rolled engine's ticks that run a forward and a backward (1f1b, interleaved,
    # zb1, zbv): the share of the head's working set live next to the layer's backward
    # (XLA interleaves the two, which do not wait for each other).
    "rolled_head_overlap": 0.499,
    # The rolled engine without remat: one layer's backward working set (its gradients,
    # the residuals read from the ring) in units of its remat-"none" values.
    "rolled_backward_fraction": 0.203,
    # The same under remat (full, save_dots): the layer's recomputed forward and its
    # gradients, in units of its remat-"none" values (the engine's layer runs outside
    # the scan the dense fractions are fitted on). Held, not fitted: the rolled
    # training grid cannot tell it from rolled_head_overlap (both scale the layers'
    # peak), so it keeps the value the two had when the rolled grid was first fitted.
    "rolled_remat_fraction": 0.796,
    # The rolled engine on two stages of one layer each (one chunk a stage) under remat:
    # the second layer's backward working set XLA holds beside the first (every score-
    # and MLP-wide value of the stage's backward twice in its buffers, where two layers a
    # stage, or four stages of one, hold one), in units of the first's. Fitted on the
    # rolled_training_large grid alone (the others held): below 1, as the pair shares
    # the layer's weights, input and norms.
    "rolled_pair_fraction": 0.597,
}

_REMATS = ("none", "full", "save_dots")
_BACKWARD = {
    "full": "backward_layer_fraction",
    "save_dots": "backward_save_dots_fraction",
    "none": "backward_none_fraction",
}
_REQUIRED = ("layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab")
#: Width-h values per token among a layer's remat-"none" values (saved_values): the
#: input, both norms' outputs, the residual between the blocks, the two blocks' outputs.
_NONE_WIDTH_VALUES = 6
#: MLP-width values per token the backward layer of a dense MLP holds at the layers'
#: peak, in units of its input matmuls' width ``f_in`` (``d_ff``, twice that gated; ÷
#: tensor), per remat policy. Counted from XLA:CPU's buffers at the peak, the same for
#: GPT's GELU MLP (``f_in = f``; in f32, see _GELU_BF16_VALUES) and Llama's SwiGLU
#: (``f_in = 2f``): ``full``, the recomputed input matmuls, the activation's output and
#: both their gradients (4); ``save_dots``, the input matmuls read from the saved values
#: (3); ``none``, the gradients of the saved values (2).
_MLP_BACKWARD_VALUES = {"full": 4, "save_dots": 3, "none": 2}
#: The same under TSP's rings (``tsp``): one ``f_in`` and this many ``d_ff`` values past
#: it (the rings' scan carries: the up projection's forward sum, the down projection's
#: input gradient, each in and out). Counted from XLA:CPU's buffers at the peak, the
#: same at d_ff 320 and at the training grid's (GPT 512, Llama 384): GPT (``f_in = f``)
#: six under remat full, four under save_dots; Llama (``f_in = 2f``) seven and five
#: (seven in bf16 too; GPT's GELU in bf16: _GELU_BF16_VALUES). Without remat the dense
#: count.
_TSP_MLP_BACKWARD_VALUES = {"full": 5, "save_dots": 3}
#: The ``d_ff`` values a GELU MLP (not gated) in bf16 holds past its count under
#: ``full``, under either remat policy, where XLA:CPU keeps bf16 matmul outputs in bf16
#: (jax 0.12; bf16_matmul_bytes 2): counted in its buffers at the peak of gpt-tiny, all
#: bf16, dense (dp and fsdp at d_ff 320 and 512, tp and tp_sp over 8 at 640: six where
#: f32 holds four) and under TSP's rings (eight where f32 holds six); save_dots holds as
#: many as full there. jax 0.10's f32 copies hold 4.5 and 3 (dense full, save_dots) and
#: 4.5 (TSP) f32 values' bytes: not this rule.
_GELU_BF16_VALUES = 2
#: The ``d_ff`` values a gated MLP (SwiGLU) in bf16 holds at the layers' peak under
#: ``full``, where XLA:CPU keeps bf16 matmul outputs in bf16 (jax 0.12; bf16_matmul_bytes
#: 2), in place of its count (four ``f_in``: eight ``d_ff``): the recomputed gate and up
#: projections, the gate's sigmoid, the down projection's input gradient and the gate's
#: or the up projection's input gradient being computed, all bf16; XLA fuses the
#: activation's other values into them. Counted at the peak of Llama (d_ff 384 and 768)
#: on fsdp, zero1 and cp, 256 to 8,192 tokens a device: five bf16[tokens, d_ff] where f32
#: holds eight f32. A pipeline's stage holds more (eight bf16 and three f32 on dp_pp and
#: zeropp over 8): not this rule.
_GATED_BF16_VALUES = 5
#: The width-h values per token fewer that the backward layer holds under remat
#: ``full`` where fsdp gathers its weights: both norms' recomputed outputs
#: (x · rsqrt · scale), which XLA:CPU materialises when the scale is the replicated
#: parameter and fuses into their users when it is a gathered one.
_GATHERED_NORM_VALUES = 2
#: The width-h values per token and in-projection (``ModelDims.in_projections``: GPT's
#: fused qkv and up, 2; Llama's wq, wk, wv, gate and up, 5) that TSP's rings (``tsp``)
#: hold under any remat policy, in the matmul outputs' bytes: the zero-initialised
#: buffers in which the backward of a ring contracting its split kernel dimension
#: assembles the input gradient, one shard at a time (``shardkit.nn.tsp``). Counted at
#: the peak: 2 and 5, under full, save_dots and none, f32 and bf16, 256 to 4,096 tokens.
_TSP_IN_PROJECTION_VALUES = 1
#: Head-expanded K/V layouts a token's backward holds under all-gather attention
#: (attention="allgather"), beyond the gathered K/V: K and V repeated to every query head
#: over all the sequence's positions (q values each for every position of the ring − 1
#: other ranks', the own rank's counted with the layer) as the f32 operands of the
#: scores' and the context's matmuls, under any remat policy; where the layer recomputes
#: and matmul outputs are bf16 (jax 0.12) their bf16 layouts too. Counted at the peak:
#: llama-tiny with 2 heads of 32 on cp over 8, f32[64,2,64,32] and f32[64,2,32,64] (jax
#: 0.10 and 0.12, full and none), the two bf16 ones beside them under full and save_dots;
#: llama on cp over 64 in bf16, two f32[512,16,128,32] of 128 MiB and two bf16 (a third
#: f32 one where the peak falls inside the attention's backward: not counted).
_ALLGATHER_KV_LAYOUTS = 2
#: Slots the temp heap gives a head's whole hidden states (elsewhere two: the states,
#: then their gradient where the logits' buffers were) when a vocabulary-split head
#: gathers hidden states split over a sequence axis (cp, cp_usp, fsdp_cp) and their
#: gradient is f32 (f32 matmul outputs): three. The gathered states, their layout copy
#: for the head weight's gradient ([b, s, h] gathered over s, copied to [b·s, h]) and
#: their gradient (then all-reduced whole) live in a chain of overlapping ranges, and
#: XLA's heap packing gives each its own offset, although the live bytes at the peak
#: hold two (XLA's buffer assignment, gpt and llama on cp over 64: f32[65536, 512] at
#: 0, 128 and 256 MiB). fsdp's states, split over the batch, need no layout copy; a
#: bf16 gradient (jax 0.12) is converted to f32 and two slots serve.
_SEQUENCE_GATHERED_HIDDEN_SLOTS = 3
#: Copies of a gathered layer's whole f32 gradient live while XLA:CPU reduces it (fsdp,
#: TSP's gathers): the all-reduce's operand and its result, before the device keeps its
#: shard. Counted at the layers' peak on 512 devices, one row of 128 tokens a device,
#: where that reduction is the peak (bf16, jax 0.12): gpt dp_fsdp (data 32 × fsdp 16)
#: and fsdp over 512 hold two f32[512,2048], two f32[2048,512], two f32[3,16,32,512],
#: two f32[512,16,32] at an all-reduce; llama dp_fsdp the same of its own weights.
_REDUCED_LAYER_COPIES = 2
#: f32 values of tokens × h, per in-projection, live at once where tensor parallelism
#: reduces the MLP's input gradient: XLA:CPU all-reduces an in-projection's input
#: gradient in f32 (under sequence parallelism too: a reduce-scatter is that all-reduce
#: and a slice), and combines the projections that read one input into one all-reduce,
#: their operands and results live together. Read from the buffers of llama-tiny (1,024
#: × 128) on tp_sp over 8, full remat, bf16: at the layers' peak one all-reduce of the
#: gate's and the up projection's input gradients, two f32[16,64,128] operands and two
#: results (the attention's q, k and v are another, of three). GPT's fused up holds two.
_REDUCED_INPUT_GRADIENT_VALUES = 2
#: f32 values of tokens × h (the whole sequence) live at once where sequence
#: parallelism's backward, without remat, all-gathers over the sequence what it saved
#: or receives as shards: the in-projections' inputs (the two norms' outputs) and the
#: MLP's output gradient, the three gathers issued together, f32 in bf16 steps too.
#: Read from the buffers of gpt (1,024 × 128, fused qkv) on tp_sp over 8, 16 × 64
#: tokens, f32 and bf16: three f32[16,64,128] all-gather results at the layers' peak;
#: the fitted tensor_width_values (0.73) left that step at 0.83 of compiled.
_SP_GATHERED_VALUES = 3
#: Score-sized values (tokens × heads ÷ tensor × keys) live where tensor parallelism
#: all-reduces the MLP's input gradient under remat: the recomputed forward's scores and
#: softmax, which the attention's backward (after the MLP's) reads. Read from the
#: buffers of llama (1,024 × 128) on tp_sp over 8, full, bf16: f32[16,64,64] and
#: f32[16,1,64,64] at that all-reduce, on jax 0.12.0.1 and 0.12.1 alike.
_REDUCED_SCORE_VALUES = 2
#: Shards of each vocabulary table's gradient live at the head's peak where the head
#: computes on the stored shard (its logits split over the vocabulary as the table is):
#: gpt-small (tied) on fsdp over 8, two f32[6288,768]; llama-tiny at vocab 8192 × 64,
#: two f32[64,1024] of the head's and two f32[1024,64] of the lookup's zeroed gradient.
_HEAD_TABLE_SHARDS = 2
#: The same where the matmul outputs are bf16 (jax 0.12; bf16_matmul_bytes 2): one bf16
#: shard of each table, the head's gradient accumulator and the lookup's zeroed gradient,
#: which then stay through the layers' backward. Counted on llama at vocabulary 8,192 ×
#: 128, bf16: on fsdp over 4 at the head's peak, bf16[128,2048] and bf16[2048,128]; on
#: fsdp and cp_usp over 8 at the layers' peak, bf16[128,1024] and bf16[1024,128].
_HEAD_TABLE_SHARDS_BF16 = 1
#: TSP's vocabulary ring (shardkit.nn.tsp_head) at the head's peak, in its backward, by
#: the ring's size D: blocks of one step's logits' size (tokens × V/D: the logits and
#: what the backward computes from them, in two layouts) and table-sized shards (V/D × h:
#: the head's gradient accumulator as the ring passes it along, the lookup's zeroed
#: gradient). The backward's loop runs D − 3 steps; at D = 4 XLA unrolls its one step
#: and holds more of both. Counted in XLA's buffers at vocabulary 16,384 × 64 (llama-tiny
#: and gpt-tiny, 128 tokens a device), f32: on tsp over 8, five f32[128,2048]-sized
#: blocks and three shards (two f32[64,2048], a f32[2048,64]); over 4 (dp_tsp), nine
#: f32[128,4096]-sized blocks and four shards. In bf16 (llama-tiny at 8,192 × 128 over
#: 4) the blocks take half the bytes (five bf16, two f32) and the shards the same (four
#: bf16, two f32). The tables' gradients are among the shards: no whole table is held.
_RING_HEAD_BUFFERS = {"logits": (5, 9), "shards": (3, 4)}  # (D > 4, D = 4)
#: Copies of a replicated head table (dp, zero1: not gathered, not split) live at the
#: head's peak where its loss runs in chunks (a loop), in the compute dtype, by
#: precision: f32, the loop's copy of the table (the parameter itself is an argument);
#: bf16, the cast it computes with and the loop's copy of that (jax 0.10 and 0.12
#: alike). Beside them the table's gradient (f32; in bf16 on jax 0.12 the loop's bf16
#: accumulator and the result, the same bytes; jax 0.10 holds three f32 there, not
#: counted). Counted in XLA's buffers at the head's peak, gpt at vocabulary 8,192 × 128
#: (8 chunks): on zero1 over 8 in f32, f32[8192,128] (the gradient) and f32[1,8192,128]
#: (the loop's parameter); on dp over 8 in bf16, four bf16[8192,128]-sized values (the
#: cast, the loop's parameter, the gradient's accumulator and the gradient).
_HEAD_LOOP_COPIES = {False: 1, True: 2}
#: Table-sized shards a tied table's gradient holds beyond its stored shard through the
#: layers' backward on TSP's rings, where the head and the lookup each leave a shard of
#: it (the lookup's zeroed and scattered into). gpt-tiny at vocabulary 8,192 × 64 on tsp over 8:
#: three f32[1024,64] at the layers' peak; llama-tiny (untied), one of each table's.
_TIED_RING_TABLE_SHARDS = 2


def _saved_bytes(values: float, remat: str, x: float, act: float, dot: float) -> float:
    """Bytes per token of ``values`` a layer saves: its matmul outputs (and its inputs) at
    ``dot`` bytes, but without remat the six width-``x`` values of the residual stream and
    the norms (:data:`_NONE_WIDTH_VALUES`) at ``act``."""
    elementwise = _NONE_WIDTH_VALUES * x if remat == "none" else 0.0
    return elementwise * act + (values - elementwise) * dot


def _scattered_whole(vocab: int, tokens: float, split: float) -> bool:
    """Whether XLA scatters the token lookup's gradient into the whole table: it is the
    table split over ``split`` devices that also split the tokens (fsdp, the sequence
    axes, tensor under SP), and the SPMD partitioner either scatters each device's rows
    into a whole zeroed table (then all-reduces it) or gathers the rows over those
    devices and scatters them into its shard: the whole table where the vocabulary is
    no larger than the tokens gathered (``tokens`` a device × ``split``). Read from
    XLA's buffers, llama-tiny at h 128 on fsdp over 8: f32[1024,128] scattered whole at
    1,024 tokens, the [130,128] shard at a vocabulary of 1,040; the same cut on tp_sp,
    tsp_gspmd and cp_usp. Unsplit tokens (``split`` 1, tensor parallelism without SP)
    scatter into the shard.

    Example:
      >>> _scattered_whole(1024, tokens=128, split=8), _scattered_whole(1040, 128, 8)
      (True, False)
    """
    return split > 1 and vocab <= tokens * split


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The estimated cost of one training step, per device.

    Attributes:
      arguments: bytes of the step's inputs: stored state and the token batch.
      temp: bytes of XLA's temp heap at its peak (the sum of ``terms``).
      wire_bytes_by_kind: ring wire bytes per step by collective kind.
      terms: the temp bytes at the peak by the report's term names.
      state: the arguments' parts (``params``, ``optimizer``, ``batch``).
      phase: the phase the peak is in (``layers``, ``head_loss``, ``optimizer_step``).
      phases: the temp peak of each phase.
      notes: the counts used, human-readable.
      seconds: how long the estimate took.
    """

    arguments: float
    temp: float
    wire_bytes_by_kind: Mapping[str, float]
    terms: Mapping[str, float]
    state: Mapping[str, float]
    phase: str
    phases: Mapping[str, float]
    notes: tuple[str, ...]
    seconds: float = 0.0

    @property
    def total(self) -> float:
        """Arguments plus temp at the peak, bytes per device (the donated state is
        updated in place)."""
        return self.arguments + self.temp

    @property
    def wire_bytes(self) -> float:
        """All wire bytes per step."""
        return float(sum(self.wire_bytes_by_kind.values()))

    def to_json(self) -> dict[str, Any]:
        """The estimate as plain data (bytes per device)."""
        return {
            "arguments": self.arguments,
            "temp": self.temp,
            "total": self.total,
            "wire_bytes_by_kind": dict(self.wire_bytes_by_kind),
            "wire_bytes": self.wire_bytes,
            "terms": dict(self.terms),
            "state": dict(self.state),
            "phase": self.phase,
            "phases": dict(self.phases),
            "notes": list(self.notes),
            "seconds": self.seconds,
        }


def saved_values(
    dims: ModelDims, remat: str, *, seq: int, t: int = 1, sp: bool = False, bf16: bool = False
) -> float:
    """Values per token one scanned layer keeps for its backward pass, per remat policy.

    With ``h`` the width, ``q = n_heads·head_dim``, ``k = n_kv_heads·head_dim``, ``f``
    the MLP width (``f_in = 2f`` gated: gate and up), ``a`` heads and ``s`` the keys per
    query (``seq``); what tensor parallelism splits ÷ ``t``, the width-``h`` values too
    under sequence parallelism (``sp``). As XLA's CPU program keeps them (counted from
    its buffers at the peak, GPT and Llama):

    - ``full``: the layer input, ``h``;
    - ``save_dots`` (matmul outputs without batch dimensions): the input, q/k/v, the
      attention's output projection and the MLP's input matmuls: ``2h + (q + 2k + f_in)/t``;
    - ``none``: everything the backward reads: eight width-``h`` values (six the
      residual stream's and the norms', :data:`_NONE_WIDTH_VALUES`, and the two blocks'
      output projections), q/k/v and the attention context (``2q + 2k``), the softmax's
      scores and exponentials (``2·a·s``; from jax 0.12.1, whose softmax saves its
      exponentials alone, ``a·s``: ``_SCORE_BUFFERS``; under ``bf16`` the probabilities
      alone, ``a·s``: :func:`shardkit.nn.attention.masked_softmax` keeps nothing else),
      and the MLP's (:func:`_mlp_none_values`: ``5f`` for GELU's, ``3·f_in`` for
      SwiGLU's): ``8h + (2q + 2k + 2as + mlp)/t``.

    A mixture-of-experts MLP's values replace the MLP's
    (:func:`shardkit.report.analytic_moe.mlp_values`).

    Example:
      >>> d = ModelDims(layers=1, d_model=64, n_heads=8, n_kv_heads=8, d_ff=256, vocab=256)
      >>> saved_values(d, "full", seq=128), saved_values(d, "save_dots", seq=128)
      (64.0, 576.0)
      >>> saved_values(d, "none", seq=128, bf16=True)   # 8·64 + (128 + 128 + 8·128 + 5·256)
      3072.0
    """
    if remat not in _REMATS:
        raise ShardingError(f"remat is one of {list(_REMATS)}, got {remat!r}.")
    h, hd = dims.d_model, dims.head_dim
    q, k = dims.n_heads * hd, dims.n_kv_heads * hd
    f_in = (2 if dims.gated_mlp else 1) * dims.d_ff
    x = h / t if sp else h
    if remat == "full":
        return float(x)
    # a mixture of experts: its MLP's values instead (analytic_moe.mlp_values)
    moe = analytic_moe.mlp_values(dims, remat, seq=seq, t=t) if dims.n_experts else None
    if remat == "save_dots":
        if moe is not None:
            return float(2 * x + (q + 2 * k) / t + moe)
        return float(2 * x + (q + 2 * k + f_in) / t)
    scores = (1 if bf16 else _SCORE_BUFFERS) * dims.n_heads * seq
    attention = (_NONE_WIDTH_VALUES + 2) * x + (2 * q + 2 * k + scores) / t
    return float(attention + (moe if moe is not None else _mlp_none_values(dims) / t))


def _mlp_none_values(dims: ModelDims) -> float:
    """A dense MLP's values per token saved without remat (÷ tensor apart), counted in
    XLA's buffers: GELU's ``5f`` (its input matmul, the tanh approximation's
    intermediates, its output), SwiGLU's ``3·f_in = 6f`` (gate and up, the SiLU's
    intermediates, the product)."""
    return float(6 * dims.d_ff if dims.gated_mlp else 5 * dims.d_ff)


def _uncovered(
    dims: ModelDims, par: Any, pipeline: Mapping[str, Any] | None, recipe: Any
) -> str | None:
    """What of the step the estimator has no terms for (``None``: it covers it all)."""
    if dims.kv_latent:
        return (
            f"multi-head latent attention (kv_latent={dims.kv_latent}; its projections and "
            "saved values are not grouped-query attention's terms)"
        )
    if dims.n_experts and (par.stage > 1 or recipe.attention != "dense" or par.tsp > 1):
        return (
            f"a mixture of experts ({dims.n_experts} experts) under a pipeline, ring or "
            "TSP layout (its expert terms are judged on the expert-parallel recipes)"
        )
    if pipeline is not None and par.stage == 1:
        return f"pipeline={dict(pipeline)} on a mesh without a 'stage' axis"
    options = {**PIPELINE_DEFAULTS, **(pipeline or {})}
    if par.stage > 1 and options["schedule"] in SPLIT and not options["rolled"]:
        return (
            f"the zero-bubble schedule {options['schedule']!r} unrolled (rolled=False): the "
            "engine runs it rolled only; drop rolled=False (--unrolled)"
        )
    chunks = par.stage * chunks_a_stage(options)
    # Layers that do not split into the chunks the engine refuses itself. The unrolled
    # engine's terms are counted on one layer a chunk (the training grids' pipelines);
    # at two a chunk they gave 0.64-0.86 of the compiled total (the held-out grid's 18
    # pipelined points, d_model 256 on 16 devices, before it moved to the default engine).
    unrolled = par.stage > 1 and not options["rolled"]
    if unrolled and dims.layers > chunks and dims.layers % chunks == 0:
        return (
            f"the unrolled engine (rolled=False) with {dims.layers // chunks} layers a stage "
            "chunk (its terms are counted for one; at two they gave 0.64-0.86 of the "
            "compiled total); drop rolled=False (--unrolled) for the default engine"
        )
    return None


def _resolve(plan_or_recipe: Any, mesh: Any, devices: int | None) -> tuple[Any, dict[str, int]]:
    """(recipe, mesh sizes) from a plan, or a recipe with a mesh or a device count."""
    if hasattr(plan_or_recipe, "recipe") and hasattr(plan_or_recipe, "mesh"):
        if mesh is not None or devices is not None:
            raise ShardingError(
                "estimate(plan, ..., mesh=/devices=): a plan has its mesh already.\n"
                "Fix: drop mesh= and devices=, or pass the recipe's name instead of the plan."
            )
        shape = dict(plan_or_recipe.mesh.shape)
        return plan_or_recipe.recipe, {a: int(v) for a, v in shape.items()}
    recipe = recipes.get(plan_or_recipe)
    if mesh is None and devices is None:
        raise ShardingError(
            f"estimate({recipe.name!r}, ...): a recipe needs mesh= (axis sizes) or devices=.\n"
            f"Fix: estimate({recipe.name!r}, dims, devices=8, ...), or pass an sk.Plan."
        )
    if mesh is not None and devices is not None:
        raise ShardingError(
            f"estimate({recipe.name!r}, ..., mesh=..., devices={devices}): give one of them.\n"
            f"Fix: estimate({recipe.name!r}, dims, devices={devices}) or mesh={{...}} alone."
        )
    if mesh is None:
        mesh = recipe.axis_sizes(devices)
    if hasattr(mesh, "shape") and not isinstance(mesh, Mapping):
        mesh = dict(mesh.shape)
    return recipe, {a: int(v) for a, v in dict(mesh).items()}


def _dims_of(model: Any) -> ModelDims:
    if isinstance(model, ModelDims):
        return model
    dims = getattr(model, "dims", None)
    if isinstance(dims, ModelDims):
        return dims
    raise ShardingError(
        f"estimate: {type(model).__name__} declares no dimensions (its dims is {dims!r}).\n"
        f"Fix: declare them, dims=ModelDims({', '.join(f + '=...' for f in _REQUIRED)}) "
        "(shardkit.dims) in the model's factory (as examples/scanned_lm.py does), or "
        "compile the layout with `shardkit report` (sk.report.build_report) instead."
    )


def estimate_or_refusal(
    recipe: Any, dims: ModelDims, mesh: Mapping[str, int], workload: Any, pipeline: Any = None
) -> tuple[Estimate | None, str | None]:
    """What a report shows beside the compiled memory: the :func:`estimate` of a step of
    ``workload``'s sizes (a :class:`~shardkit.workload.Workload`), or ``None`` and the
    estimator's refusal on one line, for a layout it does not cover."""
    try:
        guess = estimate(
            recipe,
            dims,
            mesh=mesh,
            batch=workload.batch,
            seq=workload.seq,
            remat=workload.remat or "none",
            precision=workload.precision,
            pipeline=pipeline,
        )
    except ShardingError as e:  # a layout the estimator does not cover: it says so
        return None, " ".join(str(e).split())
    return guess, None


def estimate(
    plan_or_recipe: Any,
    model: Any,
    *,
    batch: int,
    seq: int,
    mesh: Any = None,
    devices: int | None = None,
    remat: str | None = None,
    precision: str | None = None,
    pipeline: Mapping[str, Any] | None = None,
    fit: Mapping[str, float] | None = None,
) -> Estimate:
    """The estimated memory per device and wire bytes of one AdamW training step.

    Args:
      plan_or_recipe: an ``sk.Plan``, or a recipe (name or ``Recipe``) with ``mesh=``
        (axis sizes or a ``Mesh``) or ``devices=`` (the recipe's default mesh).
      model: a :class:`~shardkit.dims.ModelDims`, or a model declaring its ``dims``
        (a reference model, a user's model of the model protocol).
      batch, seq: global batch and sequence length.
      remat: ``"none"``, ``"full"`` or ``"save_dots"`` (default: the model's, else none).
      precision: ``"f32"`` or ``"bf16"`` (default: the plan's, else f32).
      pipeline: a pipeline's options (``{"microbatches": m, "schedule": ...}``; default
        1F1B with one micro-batch per stage, as ``shardkit.report.build_report``).
      fit: constants to use in place of :data:`FIT`'s (the benchmark's fit).

    Returns:
      An :class:`Estimate`.

    Raises:
      ShardingError: a model without declared dimensions (naming the fields to
        declare), a layout the estimator does not cover (saying so), bad arguments.
    """
    start = time.perf_counter()
    recipe, sizes = _resolve(plan_or_recipe, mesh, devices)
    dims = _dims_of(model)
    remat = remat or getattr(model, "remat", None) or "none"
    precision = precision or getattr(plan_or_recipe, "precision", None) or "f32"
    if remat not in _REMATS:
        raise ShardingError(f"estimate(remat={remat!r}): remat is one of {list(_REMATS)}.")
    if precision not in ("f32", "bf16"):
        raise ShardingError(f"estimate(precision={precision!r}): 'f32' or 'bf16'.")
    if not isinstance(batch, int) or not isinstance(seq, int) or batch < 1 or seq < 1:
        raise ShardingError(f"estimate(batch={batch!r}, seq={seq!r}): positive ints, please.")
    par = recipe.parallelism(sizes)
    uncovered = _uncovered(dims, par, pipeline, recipe)
    if uncovered:
        raise ShardingError(
            f"estimate: the estimator does not cover {recipe.name} on {sizes}: {uncovered}.\n"
            "Fix: compile it with `shardkit report` (sk.report.build_report) for its "
            "measured figures."
        )
    if par.stage > 1:
        pipeline = {**PIPELINE_DEFAULTS, "microbatches": par.stage, **(pipeline or {})}
    nb = 4
    psi = dims.param_count
    workload = workload_of(dims, batch=batch, seq=seq, remat=remat, precision=precision)
    try:
        base = analytic_costs(
            recipe,
            sizes,
            workload=workload,
            psi=psi,
            param_bytes=nb * psi,
            optimizer_bytes=2 * nb * psi,
            bytes_per_value=nb,
            layer_params=dims.ringed_layer_params[0],
            in_params=dims.ringed_layer_params[1],
            vocab_tables=dims.vocab_tables,
            pipeline=pipeline,
            stack_param_bytes=nb * dims.stack_params,
            stack_optimizer_bytes=2 * nb * dims.stack_params,
            xla_counts=True,
        )
    except ShardingError as e:
        raise ShardingError(
            f"estimate: the estimator does not cover {recipe.name} on {sizes} "
            f"({str(e).splitlines()[0]}).\nFix: compile it with `shardkit report` "
            "(sk.report.build_report) for its measured figures."
        ) from e
    if dims.n_experts:  # the experts' state split over their axis, the dispatch's wire
        base = analytic_moe.with_experts(
            base,
            dims,
            recipe,
            sizes,
            batch=batch,
            seq=seq,
            remat=remat,
            param_bytes=nb * psi,
            optimizer_bytes=2 * nb * psi,
            bytes_per_value=2 if precision == "bf16" else 4,
        )
    mem = base.memory
    fit = {**FIT, **(fit or {})}
    bf16 = precision == "bf16"
    act = fit["bf16_activation_bytes"] if bf16 else 4
    dot = fit["bf16_matmul_bytes"] if bf16 else 4  # matmul outputs
    d, f, t, c, p = par.data, par.fsdp, par.tensor, par.sequence, par.stage
    tsp = max(par.tsp, 1)
    # TSP's rings (tsp), not tsp_gspmd's gathers: weights and gradients move as shards.
    tsp_rings = tsp > 1 and par.tsp_kind == "tsp"
    m = int(pipeline["microbatches"]) if p > 1 else 1
    b = batch / (d * f * m)
    s = seq / (c * tsp)
    tokens = b * s
    sp = t > 1 and par.tensor_kind == "tp_sp"
    x = dims.d_model / t if sp else dims.d_model  # width-h values: split under SP only
    q, k = dims.n_heads * dims.head_dim, dims.n_kv_heads * dims.head_dim
    L = dims.layers / p
    per_value = (
        f"{act:g} B/activation" if act == dot else f"{dot:g} B/matmul output, {act:g} B else"
    )
    notes = [f"{recipe.name} as {par}; b={b:g} rows × s={s:g} per device, {per_value}"]

    # Arguments: the state's shards and the token batch (inputs and targets, int32).
    batch_bytes = 2 * batch / (d * f) * seq / (c * tsp) * 4
    # Tensor parallelism splits the matrices and the vocabulary tables, not the norms,
    # the row-parallel outputs' biases or a position table: those stay whole (÷ fsdp).
    whole = 0.0
    if t > 1:
        norms = (2 * dims.layers + 1) * (2 if dims.norm == "layernorm" else 1) * dims.d_model
        out_biases = 2 * dims.layers * dims.d_model if dims.biases else 0
        positions = dims.max_seq * dims.d_model if dims.position_table else 0
        whole = (norms + out_biases + positions) * nb * (1 - 1 / t) / f
    state = {
        "params": mem.params + whole,
        "optimizer": mem.optimizer + 2 * whole,
        "batch": batch_bytes,
    }
    arguments = sum(state.values())

    # Saved activations: every layer's (× the items a pipeline stage holds in flight).
    items = 1.0
    if p > 1 and not pipeline.get("rolled", True):  # the rolled engine's: _rolled_terms
        sched = pipeline.get("schedule", "1f1b")
        v = chunks_a_stage(pipeline)
        items = in_flight(sched, p, m, v) / v
    per_token = saved_values(dims, remat, seq=seq, t=t, sp=sp, bf16=bf16)
    # Ring attention (cp, TSP) keeps the K and V blocks each of the n − 1 steps received
    # for the backward pass: 2·k·(n − 1) values per local token, saved for every layer
    # without remat, else held by the layer being recomputed.
    # Ulysses keeps no other rank's K/V (its all-to-all trades heads for tokens); under
    # USP only the ring's own axis does.
    ring = 1
    if recipe.attention in ("ring", "allgather"):
        ring = int(sizes.get(recipe.attention_axis, 1))
    elif recipe.attention == "usp":
        ring = int(sizes.get(recipe.balance_axis, 1))
    ring_values = 2 * k * (ring - 1) / t
    # A ring's steps (cp, TSP, USP's ring) are rematerialised whatever the policy.
    ring_steps = recipe.attention in ("ring", "usp") and ring > 1
    if remat == "none":
        per_token += ring_values
        if ring_steps:
            # Of the scores and softmax (2·a·s; a·s under bf16) only the own block's
            # probabilities are kept, its 3 unmasked chunk pairs of 4 (zigzag): ¾·a·s/ring
            # values a token; and the steps' query and output chunks, two of width q
            # (in XLA's buffers: four q-wide halves), and each step's softmax statistics.
            scores = (1 if bf16 else _SCORE_BUFFERS) * dims.n_heads * seq
            per_token -= (scores - 0.75 * dims.n_heads * seq / ring) / t
            per_token += (2 * q + dims.n_heads * (ring - 1)) / t
    saved = items * L * tokens * _saved_bytes(per_token, remat, x, act, dot)
    notes.append(
        f"saved activations: {items:g} item(s) × {L:g} layers × {tokens:g} tokens × "
        f"{per_token:g} values ({remat}; the matmul outputs × {dot:g} B, without remat "
        f"the residual stream and norms × {act:g} B)"
    )
    # The backward layer's working set: a share (per remat policy) of the attention's
    # values, a dense MLP's count of its input width (_MLP_BACKWARD_VALUES) or an MoE
    # MLP's share of its values (moe_backward_fraction), and the width-h values
    # (backward_width_values, fewer without remat); its scores are the attention's share.
    # Ring attention works through the keys one block at a time: a query's scores there
    # are the block's, seq / ring keys; its backward recomputes the steps, as the layer's
    # under "full". Without remat elsewhere the attention's backward differentiates saved
    # matmul outputs, its gradients in their bytes (recomputed, it is f32 on XLA:CPU).
    keys = seq / ring if recipe.attention in ("ring", "usp") else seq
    recomputed = remat != "none" or ring_steps
    frac = fit[_BACKWARD["full" if remat == "none" and ring_steps else remat]]
    att = act if recomputed else dot
    # What the share is of: the attention's q/k/v, its context and that context's
    # transpose, the scores and their softmax. An MoE MLP's values take their own share
    # (moe_backward_fraction); a dense MLP's are counted (_MLP_BACKWARD_VALUES), and a
    # GELU MLP in bf16 holds full's count and two d_ff more under either policy, a gated
    # one in bf16 under full fewer (_GATED_BF16_VALUES).
    other_values = (3 * q + 2 * k + _SCORE_BUFFERS * dims.n_heads * keys) / t
    mlp = moe_values = 0.0
    if dims.n_experts:
        moe_values = analytic_moe.mlp_values(dims, "none", seq=keys, t=t)
    else:
        f_in = (2 if dims.gated_mlp else 1) * dims.d_ff / t
        gelu_bf16 = bf16 and dot == 2 and not dims.gated_mlp and remat != "none"
        counted = "full" if gelu_bf16 else remat
        mlp = _MLP_BACKWARD_VALUES[counted] * f_in
        if bf16 and dot == 2 and dims.gated_mlp and remat == "full" and p == 1:
            mlp = _GATED_BF16_VALUES * dims.d_ff / t
        if tsp_rings and remat in _TSP_MLP_BACKWARD_VALUES:
            mlp = f_in + _TSP_MLP_BACKWARD_VALUES[counted] * dims.d_ff / t
        if gelu_bf16:
            mlp += _GELU_BF16_VALUES * dims.d_ff / t
    # The rolled engine's backward working set is in units of a layer's remat-"none"
    # values as they were counted when its held rolled_remat_fraction was fitted: six
    # width-h values, the attention's and six d_ff (an MoE MLP's values instead).
    none_values = _NONE_WIDTH_VALUES * x + other_values + moe_values
    none_values += 0.0 if dims.n_experts else 6 * dims.d_ff / t
    # A ring's layers rematerialise their steps whatever the policy and keep the
    # recomputing count.
    width_values = fit["backward_width_values" if recomputed else "backward_width_values_none"]
    # fsdp's gathered norm scales: their recomputed outputs fused into their users
    if remat == "full" and f > 1 and p == 1:
        width_values -= _GATHERED_NORM_VALUES
    width = act * width_values * x
    moe = fit["moe_backward_fraction"] * moe_values
    work = tokens * (att * (frac * other_values + moe) + width + dot * mlp)
    large = ""
    if tokens >= fit["large_rows"]:  # XLA:CPU materialises what it fuses at fewer rows
        # Under sequence parallelism the width-h values of the whole sequence are the
        # gathered matmul inputs (and their transposes), in the matmul's bytes: gpt's
        # tp_sp over 8 in bf16 at 32,768 tokens holds three bf16[32768,128]; elsewhere
        # the layer's own values, f32 (dp: f32[64,64,128]).
        large_bytes = dot if sp else act
        work += fit["large_rows_width_values"] * tokens * dims.d_model * large_bytes
        large = f" + {fit['large_rows_width_values']:g} × h from {fit['large_rows']:g} rows"
    if recomputed:  # the K/V blocks' (and without remat their gradients') ring
        work += tokens * ring_values * dot
    if tsp_rings:  # each in-projection's input gradient, assembled shard by shard
        work += tokens * _TSP_IN_PROJECTION_VALUES * dims.in_projections * x * dot
    if recipe.attention == "allgather" and ring > 1:  # K/V gathered, expanded to every head
        layout_bytes = 4 + (dot if recomputed and dot < 4 else 0)
        work += tokens * _ALLGATHER_KV_LAYOUTS * q * (ring - 1) / t * layout_bytes
    scores = frac * tokens * _SCORE_BUFFERS * dims.n_heads * keys / t * att
    # Gradients: the stored shard (the scan's accumulator; ZeRO-1 reduce-scatters each
    # layer's into the optimizer's shard), the layer being differentiated whole (before
    # its reduction; fsdp scatters most of it as it is computed), and the token table's
    # whole gradient: the lookup scatters into it before any reduction (ZeRO-1: every
    # vocabulary table's, reduce-scattered after the layers). Without remat the forward
    # scan saves the weights its matmuls read where they are new values: a linen model's
    # (``pinned_weights``: sk.axes pins each sharded weight a module reads) where the
    # layout shards the layer's weights (tensor, fsdp, tsp, expert axes), pinned to their
    # sharding, a second copy of the stack's shard (counted whole: the replicated norms
    # and biases under tp, not pinned, are a small part; NNX weights are never pinned);
    # and where the layer's weights are local in bf16, every model's as cast for the
    # matmuls, counted below with the saved values in place of the pinned copy.
    zero1 = d if par.data_kind == "zero1" else 1
    shard = mem.grads / zero1
    gathered_layers = f > 1 or (tsp > 1 and not tsp_rings)
    sharded_layers = t > 1 or f > 1 or tsp > 1 or par.expert > 1
    pinned_copy = remat == "none" and dims.pinned_weights and sharded_layers
    copies = fit["gradient_copies"] * (2 if pinned_copy else 1)
    stack_shard = shard * dims.stack_params / dims.param_count
    # A weight as the step computes with it: its gathered copies and its gradient before
    # the reduction are bf16 where the matmul outputs are (the stored shard stays f32).
    wb = nb * dot / 4
    layer_grad = dims.layer_params * wb / t
    dense_layer = dims.layer_params
    if dims.n_experts and par.expert > 1:  # the experts split over their own axis
        esplit = analytic_moe.expert_split(recipe, sizes)
        dense_layer = dims.layer_params - dims.expert_params
        experts = dims.expert_params * nb / esplit
        stack_shard = dims.layers * (dense_layer * nb / (t * f) + experts)
        layer_grad = (dense_layer / t + dims.expert_params / esplit) * wb
    # TSP's rings (not tsp_gspmd's gathers) hold weights and gradients as shards: a
    # layer's gradient accumulates one shard at a time, and no layer is gathered whole.
    if tsp_rings:
        layer_grad = layer_grad / tsp
    rest = (dims.param_count - dims.stack_params) * nb / t
    tables = dims.vocab_tables if zero1 > 1 else 1
    # The token lookup's gradient, scattered into a zeroed table that lives through the
    # layers' backward where XLA scatters it whole (_scattered_whole, read without a
    # data or stage axis; with one, and for ZeRO-1's replicated tables, whole but past
    # the tokens gathered over the data axis too, below); else into the shard, after the
    # layers, as TSP's rings do (a tied table beside a data axis aside: scattered
    # whole). Tensor parallelism without SP keeps its vocabulary split there (the tokens
    # are whole).
    sp_split = t if sp else 1  # SP splits the lookup's tokens over tensor too
    lookup_split = f * tsp * sp_split
    lookup_whole = _scattered_whole(dims.vocab, tokens / sp_split, lookup_split)
    read = d == p == zero1 == 1
    if tsp_rings and dims.vocab_tables == 1 and not read:
        # A tied table beside a data (stage, ZeRO-1) axis: the lookup's gradient is
        # scattered whole into a zeroed table, in the matmul outputs' bytes, the head's
        # shard added into it (gpt dp_tsp over 8: f32[1024,128], bf16[1024,128] in bf16).
        table_grads = dims.vocab * dims.d_model * wb
    elif tsp_rings:
        # The rings' head and lookup each leave the table's gradient as a shard: a tied
        # table holds three table-sized shards where its stored gradient counts one
        # (_TIED_RING_TABLE_SHARDS more); untied, each table its own.
        tied_shards = _TIED_RING_TABLE_SHARDS if dims.vocab_tables == 1 else 0
        table_grads = tied_shards * dims.vocab * dims.d_model * nb / tsp
    elif read and not lookup_whole:
        table_grads = 0.0
    elif (
        d > 1
        and p == zero1 == 1
        and (dims.vocab_tables == 2 or sp)
        and not _scattered_whole(dims.vocab, tokens / sp_split, lookup_split * d)
    ):
        # Beside a data axis, a vocabulary larger than the tokens gathered over it too:
        # scattered into the shard, after the layers, where the table is untied or SP
        # splits the lookup's tokens (llama-tiny on dp_tp_sp, dp_fsdp and dp_tsp_gspmd
        # over 2 × 4 at vocabulary 8,192: f32[2048,64]; at 1,024 the whole f32[1024,64];
        # gpt-tiny's tied table on dp_tp_sp the shard, on dp_fsdp the whole table).
        table_grads = 0.0
    elif read and t > 1 and not sp:
        table_grads = dims.vocab * dims.d_model * wb * (1 / t - 1 / (t * f * tsp))
    else:
        table_grads = tables * dims.vocab * dims.d_model * wb * (1 - 1 / (t * f * tsp * zero1))
    if remat == "none" and bf16 and p == 1 and not gathered_layers:
        # The forward scan saves each layer's weights as cast for its matmuls, live from
        # the forward to the backward: in the matmul outputs' bytes, whole where the
        # weights are (ZeRO-1's too; its gradient is the shard). Counted in XLA's buffers,
        # llama-tiny over 8: bf16[2,256,64] beside dp's one f32 gradient sum (jax 0.12);
        # jax 0.10 saves f32 copies. No fitted constant.
        cast_weights = L * layer_grad  # the local layer in wb bytes, as its gradient
        saved += cast_weights
        copies = fit["gradient_copies"]
        notes.append(
            f"saved weights: {L:g} layers × {cast_weights / L:,.0f} B, as cast for the matmuls "
            f"({dot:g} B a value), saved by the forward scan; one gradient sum beside them"
        )
    gathered = 0.0
    if gathered_layers:
        gathered = fit["gathered_weight_copies"] * dense_layer * wb / t
        layer_grad *= fit["scattered_layer_gradient"]
    if p > 1 and f > 1:  # zeropp: the stage's layers, embedding and head gathered per unit
        gathered += (L * dense_layer * nb / t + rest) * dot / 4
    grads = copies * stack_shard + (shard - stack_shard) + layer_grad + table_grads
    notes.append(
        f"backward layer: {tokens:g} tokens × ({frac:g} × {other_values:g} values + "
        f"{mlp:g} MLP values + {moe:g} MoE values + "
        f"{width_values:g} width-h{large}); gradients: "
        f"{copies:g} × the shard + one "
        f"layer's {layer_grad:,.0f} B + the tables' unreduced {table_grads:,.0f} B"
    )
    # Tensor parallelism's width-h values of the whole sequence: the activation
    # reductions' operands and results, the norms' outputs copied for the split matmuls
    # (under sequence parallelism the all-gathered sequence).
    collective = 0.0
    if sp and remat == "none":  # the saved shards gathered back, f32 (_SP_GATHERED_VALUES)
        collective = _SP_GATHERED_VALUES * tokens * dims.d_model * 4
    elif t > 1:
        collective = fit["tensor_width_values"] * tokens * dims.d_model * act
    layers_terms = {
        "gradients": grads,
        "collective buffers": collective,
        "saved activations": saved,
        "gathered weights": gathered,
        "attention scores": scores,
        "recomputation": work - scores,
    }

    # The head and loss. A pipeline on its own axes only (no tensor or sequence axis
    # left to XLA) runs the last stage's head through Stages.post_grad, the reference
    # models' in-place head_loss_and_grad: token chunks, vocabulary slices, no layout
    # copy of the weight. Elsewhere the chunked cross-entropy's f32 buffers.
    rolled = p > 1 and pipeline.get("rolled", True)
    head_rules = recipe.step_activation_rules(sizes, tokens=batch * seq, vocab=dims.vocab)
    if p > 1 and t == 1 and c * tsp == 1 and dims.chunked_head:
        head = head_grad_peak_bytes(
            tokens=max(1.0, tokens),
            vocab=dims.vocab,
            d_model=dims.d_model,
            bytes_per_value=act,
        )
        notes.append(f"head and loss: in place, token chunks, {head:,.0f} B")
    else:
        head, chunks = _chunked_head(
            dims,
            recipe,
            sizes,
            fit,
            head_rules,
            batch=batch,
            seq=seq,
            m=m,
            t=t,
            tsp=tsp,
            tsp_rings=tsp_rings,
            act=act,
            dot=dot,
            nb=nb,
            rolled=rolled,
            gathered_sequence=c * tsp > 1 and not tsp_rings and dot == 4,
            whole_logits=p > 1,
        )
        notes.append(f"head and loss: {chunks} chunk(s), {head:,.0f} B")
    if rolled:
        phases_terms = _rolled_terms(
            dims,
            par,
            pipeline,
            tokens=tokens,
            remat=remat,
            seq=seq,
            none_values=none_values,
            act=act,
            dot=dot,
            bf16=bf16,
            nb=nb,
            grad_shard=mem.grads,
            head=head,
            fit=fit,
            notes=notes,
        )
    else:
        # The head runs before the layers' backward, and the tables' gradients are the
        # only ones then: whole, where the head computes with a gathered copy of its
        # table (its logits split over the tokens); where it computes on the stored
        # shard (the logits split over the vocabulary as the table is: a vocabulary
        # larger than the tokens), two f32 shards of each table (_HEAD_TABLE_SHARDS),
        # one in the matmul outputs' bytes where those are bf16.
        head_rest = rest
        head_split, stored_split = head_table_splits(recipe, sizes, rules=head_rules)
        if p == 1 and not tsp_rings and head_split == stored_split > t:
            table = dims.vocab_tables * dims.vocab * dims.d_model * nb
            shards = _HEAD_TABLE_SHARDS if dot == 4 else _HEAD_TABLE_SHARDS_BF16 * wb / nb
            head_rest = rest - table / t + shards * table / head_split
        elif tsp_rings:  # the ring's table shards are the head's (_RING_HEAD_BUFFERS)
            head_rest = rest - dims.vocab_tables * dims.vocab * dims.d_model * nb / t
        elif p == 1 and dims.vocab_tables == 2 and not lookup_whole:
            # An untied token table's gradient is the lookup's, after the layers' backward:
            # where the lookup scatters into the table's shard (ZeRO-1: the optimizer's
            # shard), only that shard, zeroed in the matmul outputs' bytes, at the head's
            # peak (llama at vocabulary 8,192 × 128 in bf16: bf16[1024,128] on tsp_gspmd
            # and zero1 over 8, bf16[2048,128] on dp_fsdp over 2 × 4).
            table = dims.vocab * dims.d_model
            head_rest = rest - table * nb / t + table * wb / (stored_split * zero1)
        if p == 1 and not tsp_rings and head_split == stored_split == 1 and chunks > 1:
            # A replicated head table read by the chunks' loop: the loop's copy of it (and
            # in bf16 the cast it reads), in the compute dtype (_HEAD_LOOP_COPIES).
            loop_copies = _HEAD_LOOP_COPIES[bf16]
            head_rest += loop_copies * dims.vocab * dims.d_model * (2 if bf16 else 4)
            held = "a copy" if loop_copies == 1 else f"{loop_copies} copies"
            notes.append(f"head's loop: {held} of its replicated table")
        reduced = mem.grads
        if p > 1:
            reduced = _pipeline_reduction(par, dims.stack_params / p * nb / t, rest, mem.grads)
        phases_terms = _unrolled_terms(layers_terms, head_rest, saved, head, reduced)
        if gathered_layers:
            # The layers' other moment: the reduction of a gathered layer's gradient,
            # which XLA:CPU all-reduces whole in f32 (then keeps its shard), operand and
            # result live at once beside the state's shards, the saved activations and
            # the tables' unreduced gradient; the layer's working set and its gathered
            # weights are freed by then. The peak where the layer's weights outweigh its
            # activations (512 devices, one row of 128 tokens each). No fitted constant.
            reduction = {
                "gradients": grads - layer_grad + _REDUCED_LAYER_COPIES * dense_layer * nb / t,
                "saved activations": saved,
            }
            if sum(reduction.values()) > sum(layers_terms.values()):
                phases_terms["layers"] = reduction
                notes.append(
                    f"layers' peak at the gradient's reduction: {_REDUCED_LAYER_COPIES} × "
                    f"one layer's {dense_layer * nb / t:,.0f} B whole in f32 (all-reduced)"
                )
        if t > 1 and p == 1:
            # Tensor parallelism's other moment: the reduction of the MLP's input
            # gradient (_REDUCED_INPUT_GRADIENT_VALUES per projection, gate and up where
            # separate), beside the gradients, the saved activations, the gathered
            # weights and the share of the backward layer's working set still live then
            # (tensor_reduction_fraction). A recomputed forward's scores and softmax stay
            # (_REDUCED_SCORE_VALUES): the attention's backward, after the MLP's, reads
            # them. The peak where the MLP's projections are separate (Llama) or its
            # width is small beside h.
            mlp_in = 2 if dims.gated_mlp and dims.in_projections > 2 else 1
            reduced = _REDUCED_INPUT_GRADIENT_VALUES * mlp_in * tokens * dims.d_model * 4
            moment = {
                "gradients": grads,
                "saved activations": saved,
                "gathered weights": gathered,
                "collective buffers": reduced,
                "recomputation": fit["tensor_reduction_fraction"] * (work - scores),
            }
            if recomputed:  # the recomputed forward's, for the attention's backward
                score = tokens * dims.n_heads * keys / t * act
                moment["attention scores"] = _REDUCED_SCORE_VALUES * score
            if sum(moment.values()) > sum(phases_terms["layers"].values()):
                phases_terms["layers"] = moment
                notes.append(
                    f"layers' peak at the MLP's input-gradient all-reduce: {mlp_in} × "
                    f"{_REDUCED_INPUT_GRADIENT_VALUES} f32 values of {tokens:g} tokens × "
                    f"h (operand and result)"
                )
    for v in phases_terms.values():
        v["heap fragmentation"] = fit["heap_fragmentation"] * sum(v.values())
    phases = {k: float(sum(v.values())) for k, v in phases_terms.items()}
    phase = max(phases, key=lambda k: phases[k])
    terms = {k: float(v) for k, v in phases_terms[phase].items() if v > 0}
    return Estimate(
        arguments=float(arguments),
        temp=phases[phase],
        wire_bytes_by_kind=dict(base.wire_bytes_by_kind),
        terms=terms,
        state=state,
        phase=phase,
        phases=phases,
        notes=tuple(notes),
        seconds=time.perf_counter() - start,
    )


def _chunked_head(
    dims,
    recipe,
    sizes,
    fit,
    rules,
    *,
    batch,
    seq,
    m,
    t,
    tsp,
    tsp_rings,
    act,
    dot,
    nb,
    rolled,
    gathered_sequence=False,
    whole_logits=False,
) -> tuple[float, int]:
    """The chunked cross-entropy's bytes and its chunks: its hidden states whole, beside
    the larger of their gradient and its f32 logits and weight buffers (times
    ``head_copies``). ``rules``: the step's activation rules. ``gathered_sequence``:
    hidden states split over a sequence axis with an f32 gradient, which a
    vocabulary-split head gathers into three heap slots
    (:data:`_SEQUENCE_GATHERED_HIDDEN_SLOTS`). A weight gathered for the head is held in
    ``dot`` bytes, the matmul outputs' (three bf16 tables on jax 0.12 in bf16).

    TSP's vocabulary ring (shardkit.nn.tsp_head) scores one step's logits at a time, the
    local tokens against one V/D shard, unchunked; its table is never gathered: its
    logits-sized blocks and table-sized shards are counted as XLA holds them
    (:data:`_RING_HEAD_BUFFERS`), not ``head_copies`` of the other heads'. The rolled
    pipeline engine's head is one micro-batch's, its tables gathered once a step
    (counted with the stage's weights), so it holds no layout copy of the weight.

    ``whole_logits``: a pipeline whose stages leave an axis to XLA (``dp_tp_sp_pp``'s
    tensor) runs ``jax.value_and_grad`` of the stages' ``post``, which in the reference
    models computes the micro-batch's logits at once (one chunk). At the head's peak XLA
    holds three values of them: gpt-tiny at vocabulary 8,192 on ``dp_tp_sp_pp`` over 8,
    the exponentials, the logits' gradient and its transpose, each f32 of 4 rows × 64 ×
    4,096 (V / tensor); llama at 8,192 × 128 over 4 in bf16, two f32[8,64,4096] and a
    bf16[512,4096] product.
    """
    spec = rules.spec(LOGITS, mesh=sizes)
    chunks = 1
    if dims.chunked_head and not whole_logits:
        chunks = dims.loss_chunks or auto_chunks(
            seq, dims.vocab, dims.d_model, quantum=spec_split(spec, sizes, (1,))
        )
    vocab_split = spec_split(spec, sizes, (2,))
    copy = 0.0  # the rolled engine's
    if tsp_rings and dims.chunked_head:  # the ring's own count below
        chunks, vocab_split = 1, vocab_split * tsp
    elif not rolled:
        copy = head_weight_copy_bytes(
            dims, recipe, sizes, bytes_per_value=nb, rules=rules, act_bytes=dot
        )
    tokens, token_split = batch * seq / m, spec_split(spec, sizes, (0, 1))
    logits_of = dict(
        tokens=tokens, vocab=dims.vocab, d_model=0, token_split=token_split, vocab_split=vocab_split
    )
    # The hidden states in the head's layout, whole, and next to them either the logits'
    # and the weight's buffers (head_copies of them) or, once those are freed, the hidden
    # states' gradient: vocabulary-split logits on 64 or 512 devices gather every token's
    # hidden states, 128 MiB, and the heap holds them twice (thrice, gathered over a
    # sequence axis with an f32 gradient: _SEQUENCE_GATHERED_HIDDEN_SLOTS).
    hidden = tokens / token_split * dims.d_model * act
    if tsp_rings and dims.chunked_head and not rolled:
        # TSP's ring, counted from its structure (_RING_HEAD_BUFFERS): its logits-sized
        # blocks (f32; in bf16 half of them the matmul outputs') and its table-sized
        # shards (f32's bytes) beside the hidden states.
        unrolled = int(tsp <= 4)  # the backward's loop of tsp − 3 steps, unrolled
        logits = head_loss_peak_bytes(
            **logits_of, live_logits=_RING_HEAD_BUFFERS["logits"][unrolled]
        )
        shards = _RING_HEAD_BUFFERS["shards"][unrolled] * dims.vocab * dims.d_model * nb / tsp
        return hidden + max(hidden, logits * dot / 4 + shards / t), chunks
    # The logits' and the weight's buffers: the head's count without its hidden states.
    buffers = head_loss_peak_bytes(
        **logits_of, chunks=chunks, bytes_per_value=act, weight_copy_bytes=copy
    )
    slots = 2
    if gathered_sequence and vocab_split > 1 and not rolled:
        slots = _SEQUENCE_GATHERED_HIDDEN_SLOTS
    return (slots - 1) * hidden + max(hidden, fit["head_copies"] * buffers), chunks


def _unrolled_terms(layers_terms, rest, saved, head, grads) -> dict[str, dict[str, float]]:
    """The phases of a step whose layers run in one scan (or the unrolled pipeline
    engine): the layers' backward, the head and loss, the optimizer step."""
    return {
        "layers": layers_terms,
        "head_loss": {
            # the head runs before the layers' backward: only the tables' gradient
            "gradients": rest,
            "saved activations": saved,
            "logits / loss": head,
        },
        "optimizer_step": {"gradients": grads},
    }


def _rolled_values(
    dims: ModelDims, remat: str, *, seq: int, t: int = 1, sp: bool = False, bf16: bool = False
) -> tuple[float, float]:
    """Values per token (f32-sized) of one layer the rolled pipeline engine stores:
    (what the layer's ``jax.vjp`` keeps, its ring's residuals; what a zero-bubble B
    leaves its W).

    The vjp's residuals, counted from the engine's rings (gpt-tiny and llama-tiny):
    ``full``: the layer input ``h``; ``save_dots``: :func:`saved_values`'; ``none``:
    eight width-``h`` values, four of the attention's width ``q`` (q, k and v, GQA's k and
    v repeated to the query heads, and the context), the scores (three f32 leaves, which
    XLA stores as two rings: two are one value) and their mask (a byte, ¼), two per
    head (the softmax's max and sum), six of the MLP's width and the norms' statistics
    (two per norm, four under LayerNorm). Under ``bf16`` the scores are one f32 ring and
    no mask (counted on llama d256's zeropp without remat, a held-out point). From jax
    0.12.1 the f32 softmax keeps its exponentials alone: one score ring, the mask, no
    max and sum (its ``jax.vjp`` residuals).

    W's inputs (``shardkit.parallel.wgrad``'s frontier): the output cotangent of each
    weight matmul (q, k, v, the MLP's inputs) and width-``h`` ones for the attention's
    and the MLP's outputs and the norms' weights (two per norm, four under LayerNorm),
    ``q + 2k + f_in + h·(2 + norms)``; under remat also what B recomputed that W reads:
    ``2f + 3h + 2`` (the MLP's activation input and output, the layer and block inputs,
    the norms' statistics), under ``save_dots`` besides two width-``h`` values and the
    scores ``a·s``.
    """
    h, hd, a, f = dims.d_model, dims.head_dim, dims.n_heads, dims.d_ff
    q, k = a * hd, dims.n_kv_heads * hd
    f_in = (2 if dims.gated_mlp else 1) * f
    x = h / t if sp else h
    norms = 4 if dims.norm == "layernorm" else 2
    if remat == "none":
        # jax 0.12.1's softmax keeps its exponentials alone (_SCORE_BUFFERS 1): one
        # score ring and the mask, and no row statistics
        scores = (1.0 if bf16 else _SCORE_BUFFERS + 0.25) * a * seq
        stats = 2 * a if _SCORE_BUFFERS == 2 else 0.0
        res = 8 * x + (4 * q + scores + stats + 6 * f) / t + 2 * norms
    else:
        res = saved_values(dims, remat, seq=seq, t=t, sp=sp)
    w_in = (q + 2 * k + f_in) / t + x * (2 + norms)
    if remat != "none":
        w_in += 2 * f / t + 3 * x + 2
    if remat == "save_dots":
        w_in += 2 * x + a * seq / t
    return float(res), float(w_in)


@functools.lru_cache(maxsize=512)  # the planner asks for the same schedules again
def _rolled_slots(
    schedule: str, p: int, m: int, v: int, units: int = 1
) -> tuple[int, int, int, int]:
    """(residual slots, d loss / d y slots, W-input slots, unrolled backward ticks) of
    the rolled engine (``shardkit.parallel.pipeline._Pipeline._rolled_ticks``): the first
    three are the slots it allocates (:attr:`shardkit.parallel.schedules.Schedule.buffers`,
    one definition for both). The engine loops over runs of ticks of one kind (cut where
    a scheduling unit starts) and unrolls runs shorter than 3: the last count is the most
    backward ticks in one straight-line stretch of unrolled ticks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # m < p: the schedule's own warning
        sched = make(schedule, p, m, v)
    buffers = sched.buffers  # what the engine allocates (shardkit.parallel.schedules)
    tables = sched.tables()
    names = ["f_valid", "b_valid", "f_first", "f_last", "b_first", "b_last"]
    names += ["w_valid"] if sched.split else []
    kinds = [tuple(bool(tables[n][t].any()) for n in names) for t in range(sched.ticks)]
    if schedule == "zbv":  # its ends alternate: runs cut by the work alone
        kinds = [k[:2] + k[6:] for k in kinds]
    windows = {round(i * sched.ticks / units) for i in range(units)}
    runs: list[list[int]] = []
    for t in range(sched.ticks):
        if runs and t not in windows and kinds[t] == kinds[runs[-1][0]]:
            runs[-1].append(t)
        else:
            runs.append([t])
    # straight-line stretches of unrolled ticks between loops: their backward ticks
    unrolled, stretch = 0, 0
    for r in runs:
        stretch = stretch + sum(bool(tables["b_valid"][t].any()) for t in r) if len(r) < 3 else 0
        unrolled = max(unrolled, stretch)
    return buffers.residuals, buffers.loss_grad, buffers.w_inputs, unrolled


def _rolled_terms(
    dims: ModelDims,
    par: Any,
    pipeline: Mapping[str, Any],
    *,
    tokens: float,
    remat: str,
    seq: int,
    none_values: float,
    act: float,
    dot: float,
    bf16: bool,
    nb: int,
    grad_shard: float,
    head: float,
    fit: Mapping[str, float],
    notes: list[str],
) -> dict[str, dict[str, float]]:
    """The rolled pipeline engine's temp, counted from its structure.

    A stage runs its ticks in loops; everything below is live across them, so the peak
    is these buffers plus one layer's backward or the head's, the larger:

    - ``saved activations``: the residual rings, ``[slots, L/(p·v), ...]`` per leaf, each
      slot one micro-batch's residuals of one chunk's layers (:func:`_rolled_slots`),
      what a layer's vjp keeps per remat policy (:func:`_rolled_values`); the last
      chunk's d loss / d y (width-h) slots; zb1 / zbv the ring of W's inputs
      (``w_ring`` slots × the chunk's layers × :func:`_rolled_values`' second count);
    - ``gathered weights``: zeropp's stage and its embedding and head, gathered over
      fsdp once per scheduling unit, and the layer the loop slices out of the stack;
    - ``gradients``: the unit's f32 accumulator of the stage's weights and the
      embedding and head's (with more units, a second accumulator and the shard; a
      second copy where a one-layer chunk's backwards run in an unrolled stretch);
    - ``recomputation`` / ``logits / loss``: one layer's backward working set (one at a
      time in the backward scan), with the share of the head's live beside it where a
      tick runs both (``rolled_head_overlap``), or the head's; and where a chunk is one
      layer, the layers XLA recomputes ahead in a stretch of unrolled ticks.
    """
    p, m, t, f = par.stage, int(pipeline["microbatches"]), par.tensor, par.fsdp
    sched = pipeline.get("schedule", "1f1b")
    v = chunks_a_stage(pipeline)
    units = 1 if pipeline.get("unit") is None else math.ceil(m / int(pipeline["unit"]))
    ring, dy, w_ring, unrolled = _rolled_slots(sched, p, m, v, units)
    chunk = dims.layers / (p * v)
    sp = t > 1 and par.tensor_kind == "tp_sp"
    res, w_in = _rolled_values(dims, remat, seq=seq, t=t, sp=sp, bf16=bf16)
    # the residuals split as the scan's; W's cotangents are matmul outputs
    x = dims.d_model / t if sp else dims.d_model
    saved = ring * chunk * tokens * _saved_bytes(res, remat, x, act, dot)
    saved += dy * tokens * dims.d_model * act + w_ring * chunk * tokens * w_in * dot
    stage_bytes = dims.stack_params / p * nb / t
    rest = (dims.param_count - dims.stack_params) * nb / t
    # The stage's layers (and the embedding and head) gathered over fsdp once per unit
    # (zeropp), and the layer the loop runs sliced out of the stack: its weights and
    # their layout copies (``gathered_weight_copies``, as a scanned layer's); as the step
    # computes with them, in the matmuls' bytes.
    layer_bytes = dims.layer_params * nb / t
    gathered = (stage_bytes + rest if f > 1 else 0.0) + fit["gathered_weight_copies"] * layer_bytes
    gathered *= dot / 4
    # The unit's f32 accumulator of the stage's gradient (a second one where the next
    # unit starts while the last one's is reduce-scattered, and the stored shard they
    # are reduced into), the embedding and head's, carried through the ticks; a single
    # unit's stored shard is written after them. Where a chunk is one layer and a stretch
    # of unrolled ticks runs two or more backwards, the straight-line ticks update the
    # accumulator outside any loop and XLA holds a second copy of it (counted in its
    # buffers: two of each stacked [v, 1, ...] gradient on gpt d=384 and llama d=512,
    # interleaved over 4 chunks; one where no stretch runs two backwards).
    grads = stage_bytes + rest
    one_layer_chunks = chunk == 1 and v > 1  # of several a stage (interleaved, zbv)
    second = one_layer_chunks and unrolled >= 2
    if second:
        grads += stage_bytes
    if units > 1:
        grads += stage_bytes + stage_bytes / f
    # one layer's backward: its recomputed forward and gradients (remat), or, with its
    # residuals read from the ring (none), the gradients alone
    frac = fit["rolled_backward_fraction" if remat == "none" else "rolled_remat_fraction"]
    work = frac * tokens * none_values * act
    # A chunk of one layer: XLA unrolls its one-trip layer loop, and in a stretch of
    # unrolled ticks (short runs, between loops) it recomputes every backward's layer
    # ahead (the recomputation does not wait for the incoming gradient): all but two of
    # the stretch's backwards' recomputed layers are live besides the one running
    # (measured: interleaved on 2 stages, m = 4, one layer per chunk, nine backwards in
    # one stretch, 3.3x the temp of 1f1b's; stretches of two backwards hoist none). One
    # chunk a stage (1f1b, zb1) hoists none either: gpt-tiny's dp_pp over 2 stages holds
    # the same buffers at m = 2, 4 and 8 (three and five backwards in a stretch, or none),
    # scaled by the micro-batch: the pair below, whatever m.
    hoisted = 0.0
    if one_layer_chunks and remat != "none" and unrolled > 2:
        hoisted = (unrolled - 2) * tokens * none_values * act
    # Two stages of one layer each (v = 1) under remat: XLA holds a second layer's
    # backward working set beside the one running, at m = 2, 4 and 8 alike (counted in
    # gpt d128's buffers at 4,096 tokens a micro-batch: four score-sized f32 values where
    # two layers a stage hold two, six d_ff-wide where they hold four; on four stages of
    # one layer, one set). Without remat the residual rings are copied instead: not counted.
    pair = p == 2 and chunk == 1 and v == 1 and remat != "none"
    if pair:
        hoisted += fit["rolled_pair_fraction"] * work
    notes.append(
        f"rolled {sched}: {ring} residual slot(s) × {chunk:g} layer(s), {dy} d loss/d y "
        f"slot(s), {w_ring} W-input slot(s); the stage's {stage_bytes:,.0f} B gathered "
        f"{'once per unit' if f > 1 else '(stored whole)'} and its f32 accumulator"
        + (f" (twice: {unrolled} backwards in one unrolled stretch)" if second else "")
        + (
            f"; one layer a stage on two: {fit['rolled_pair_fraction']:g} × a second backward"
            if pair
            else ""
        )
    )
    base = {"gradients": grads, "saved activations": saved, "gathered weights": gathered}
    overlap = fit["rolled_head_overlap"] * head if sched != "gpipe" else 0.0
    return {
        "layers": {**base, "recomputation": work + hoisted, "logits / loss": overlap},
        "head_loss": {**base, "logits / loss": head},
        "optimizer_step": {"gradients": _pipeline_reduction(par, stage_bytes, rest, grad_shard)},
    }


def _pipeline_reduction(par: Any, stage_bytes: float, rest: float, grad_shard: float) -> float:
    """A pipeline's gradients as its engine sums them after the ticks, where the stages
    store their weights whole: the embedding's and head's (computed on the first and
    last stage) over the stages and the batch axes, the stage's over the batch axes,
    each psum's f32 operand and result live at once (llama-tiny at vocabulary 8,192 on
    dp_pp over 4 × 2: both tables' f32[8192,64] gradients and their all-reduce results
    at the step's peak). Where fsdp stores them as shards (zeropp) the stored shard, as
    before: that moment is not read from XLA's buffers yet."""
    if par.fsdp > 1:
        return grad_shard
    reduced = 2 * rest + (2 if par.data > 1 else 1) * stage_bytes
    return max(grad_shard, reduced)


def against(
    e: Estimate,
    compiled: Mapping[str, float],
    terms: Mapping[str, float] | None = None,
    *,
    tolerance: float = 0.10,
) -> dict[str, Any]:
    """The estimate next to the compiled figures, and the terms off by more than
    ``tolerance``.

    Args:
      e: the estimate.
      compiled: the compiled memory per device (``arguments``, ``temp``, ``total``).
      terms: the compiled temp at its peak by term (the report's itemised memory).
      tolerance: relative gap beyond which a row is off.

    Returns:
      ``{"rows": [[name, estimated, compiled, ratio], ...], "off": [names]}``: arguments,
      temp, total, then each term either side has; ``off`` the terms (or, without
      terms, the parts) off by more than ``tolerance``, the largest gap in bytes first.

    Example:
      >>> e = Estimate(10.0, 20.0, {}, {"gradients": 5.0, "saved activations": 15.0}, {},
      ...              "layers", {}, ())
      >>> r = against(e, {"arguments": 10, "temp": 30, "total": 40},
      ...             {"gradients": 5, "saved activations": 25})
      >>> r["rows"][2], r["off"]
      (['total', 30.0, 40.0, 0.75], ['saved activations'])
    """
    rows = [
        ["arguments", e.arguments, float(compiled["arguments"])],
        ["temp", e.temp, float(compiled["temp"])],
        ["total", e.total, float(compiled["total"])],
    ]
    parts = rows[:2]
    if terms:
        names = [*e.terms, *(t for t in terms if t not in e.terms)]
        parts = [[t, float(e.terms.get(t, 0.0)), float(terms.get(t, 0.0))] for t in names]
        parts = [p for p in parts if p[1] or p[2]]
        rows += parts
    for r in rows:
        r.append(round(r[1] / r[2], 4) if r[2] else None)
    off = [p for p in parts if p[3] is None or abs(p[3] - 1) > tolerance]
    off.sort(key=lambda p: -abs(p[1] - p[2]))
    return {"rows": rows, "off": [p[0] for p in off]}
