/* treespec's CPU kernels for x86-64: the linear layer y = x W^T + b with bf16 weights, the tree
 * attention over treespec's KV cache, and a whole Llama-style decoder stack in one call.
 *
 * One translation unit, a file per concern, included below in order: cpu_common.h (what they all
 * share), the linear layer's roads (linear_avx2.c, linear_avx512bf16.c, linear_amx.c) and its entry
 * points (linear.c), the tree attention (attention.c), the decoder stack (decoder.c), the roads'
 * peak probe (probe.c) and a drafter's whole tree (draft_tree.c).
 *
 * Linear: W is [N, K] bf16 (the nn.Linear layout), x [M, K] and y [M, N] bf16 or fp32. The
 * weight stays bf16 in memory (half the bytes of an fp32 copy: a one-row step is bound by
 * reading it). Three roads, one per process (treespec_set_isa): AVX2 + FMA reads the weight in
 * panels of 16 output columns (a copy made once per weight on the Python side,
 * cpu_kernels.road_weight), widens it to fp32 in registers (a shift or a mask: exact) and
 * accumulates with FMAs against broadcast x (linear_avx2.c); AVX512-BF16 keeps x in bf16 and
 * multiplies pairs with vdpbf16ps over the [N, K] layout (linear_avx512bf16.c); AMX multiplies
 * tiles (linear_amx.c). An fp32 x on the bf16 roads takes the AVX2 panels.
 *
 * Batch invariance: every output y[m, n] is computed by the same sequence of operations whatever
 * M is and wherever row m falls. On the AVX2 road it is one fp32 chain of fused multiply-adds
 * over k = 0 .. K - 1, then the bias; the other roads' fixed orders are in their files. A row
 * scored alone (an autoregressive step) and the same row scored among a tree's rows give the
 * same bits. Built with -ffp-contract=off, so the compiler adds no fusions of its own. The plain
 * reference of this contract is treespec.kernels.cpu_kernels.linear_reference (the same sums in
 * float64).
 *
 * Work split: threads take contiguous ranges of groups of 16 weight rows (OpenMP, the process's
 * own runtime: PyTorch's libgomp is already loaded and serves this library too); within a range,
 * rows of x go by blocks of 64 (a block stays in L2 while the weight streams past it), and
 * register tiles sized to the road do the arithmetic (AVX2: up to six x rows by one panel, one
 * row by four; see panel_rows).
 *
 * Failure: an entry point that cannot allocate its work buffers returns TREESPEC_NO_MEMORY before
 * computing anything (the Python side raises MemoryError); nothing here aborts the process.
 */

#include "cpu_common.h"

#include "linear_avx2.c"
#include "linear_avx512bf16.c"
#include "linear_amx.c"
#include "linear.c"
#include "attention.c"
#include "decoder.c"
#include "probe.c"
#include "draft_tree.c"
