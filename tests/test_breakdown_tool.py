"""`benchmarks.tools.breakdown_step` and `benchmarks.tools.breakdown_categories`: the kernel
categories, the floors, the table, and the CPU smoke run's FLOP and byte counts against the
PyTorch twin's layer shapes."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil

import pytest
import torch
from torch import nn

from benchmarks.tools import breakdown_categories as bc
from benchmarks.tools import breakdown_step as bd
from mpsnn.models.resnet import ResNet18Twin

# names as the profiler reports them on H100/H200 (cuDNN 9, cuBLAS, PyTorch, mpsnn's Triton)
NAMES = {
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_"
    "warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cudnn": bc.CONV_FWD,
    "sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_"
    "warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cudnn": bc.CONV_DGRAD,
    "sm90_xmma_wgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_"
    "warpgroupsize1x1x1_execute_segment_k_on_kernel__5x_cudnn": bc.CONV_WGRAD,
    "void cudnn::cnn::wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(int, int, int, "
    "float const*, int, float*, float const*, kernel_grad_params, unsigned long long, int, "
    "float, int, int, int, int)": bc.CONV_WGRAD,
    "void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>(int, int, int, "
    "float const*, int, float const*, int, float*, kernel_grad_params)": bc.CONV_DGRAD,
    "void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(int, "
    "int, int, float const*, int, float*, float const*, kernel_conv_params)": bc.CONV_FWD,
    "void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, "
    "false, true, (cudnnKernelDataType_t)0>(cudnn::engines_precompiled::nchw2nhwc_params_t"
    "<float>, __nv_bfloat16 const*, __nv_bfloat16*)": bc.LAYOUT,
    "void cudnn::engines_precompiled::nhwcToNchwKernel<float, __nv_bfloat16, float, true, "
    "false, (cudnnKernelDataType_t)0>(cudnn::engines_precompiled::nhwc2nchw_params_t<float>, "
    "float const*, __nv_bfloat16*)": bc.LAYOUT,
    "void cudnn::cnn::computeOffsetsKernel<false, false>(cudnn::cnn::ComputeOffsetsParams)": (
        bc.CONV_OTHER
    ),
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_"
    "segment_k_off_kernel__5x_cublas": bc.GEMM,
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
    "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)": bc.GEMM,
    "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>"
    "(float, float)": bc.GEMM,
    "_stats_partial_nhwc": bc.BN_STATS,
    "_stats_combine": bc.BN_STATS,
    "_forward": bc.BN_FWD,
    "_forward_nhwc": bc.BN_FWD,
    "_gradient_sums_partial": bc.BN_SUMS,
    "_backward_0d1d2d3de4de": bc.BN_BWD,  # an older Triton's specialization suffix
    "_multi_tensor_update": bc.OPTIMIZER,
    "_add_relu": bc.EW_TRITON,
    "_relu_times": bc.EW_TRITON,
    "_softmax_cross_entropy": bc.LOSS,
    "_channel_sums_partial": bc.BIAS_SUMS,
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>"
    ", std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul>)": bc.EW_ADD,
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
    "CUDAFunctor_add<float> >(at::TensorIteratorBase&, at::native::CUDAFunctor_add<float> "
    "const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast)": bc.EW_ADD,
    "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, "
    "std::array<char*, 3ul>, 4, TrivialOffsetCalculator<2, unsigned int>, "
    "TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithoutCast, "
    "at::native::memory::StoreWithoutCast>(int, at::native::CUDAFunctor_add<float>)": bc.EW_ADD,
    "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float, float, "
    "float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 2ul> >(int)": (
        bc.EW_MUL
    ),
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
    "threshold_kernel_impl<c10::BFloat16>(at::TensorIteratorBase&, c10::BFloat16, "
    "c10::BFloat16)::{lambda(c10::BFloat16, c10::BFloat16)#1}, std::array<char*, 3ul> >(int)": (
        bc.EW_RELU
    ),
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::"
    "TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(c10::BFloat16)#1}, "
    "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, "
    "TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, "
    "at::native::memory::StoreWithCast<1> >(int)": bc.EW_COPY,
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)": (
        bc.EW_FILL
    ),
    "void at::native::vectorized_elementwise_kernel<4, at::native::neg_kernel_cuda(at::"
    "TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda(float)#1}, "
    "std::array<char*, 2ul> >(int)": bc.EW_OTHER,
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
    "func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()(at::"
    "TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4> >(int)": (
        bc.REDUCTION
    ),
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor"
    "<float, 2, 2, 0>, std::plus<float>, float>(long)": bc.FOREACH,
    "void at::native::(anonymous namespace)::avg_pool2d_out_cuda_frame<c10::BFloat16, float>"
    "(int)": bc.POOLING,
    "Memcpy DtoD (Device -> Device)": bc.MEMCPY,
    "Memcpy HtoD (Pageable -> Device)": bc.MEMCPY,
    "Memset (Device)": bc.MEMSET,
    "some_kernel_nobody_knows": bc.OTHER,
}


@pytest.mark.parametrize("name", list(NAMES))
def test_kernel_names_fall_in_their_category(name: str) -> None:
    assert bc.classify(name) == NAMES[name]


def test_every_mpsnn_triton_kernel_has_a_category() -> None:
    import mpsnn.ops.triton as pkg
    from mpsnn.ops.triton.launch import FastKernel

    launched = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        launched |= {k for k, v in vars(module).items() if isinstance(v, FastKernel)}
    assert launched == set(bc.TRITON_KERNELS)
    assert all(c in bc.CATEGORIES for c in bc.TRITON_KERNELS.values())


def _workload() -> bc.Workload:
    w = bc.Workload(convs=[
        bc.Conv("3x3 4->8", n=2, cin=4, cout=8, kh=3, kw=3, groups=2, ho=5, wo=5,
                data_gradient=False, weight_gradient=True),
        bc.Conv("fc 8->10", n=2, cin=8, cout=10, kh=1, kw=1, groups=1, ho=1, wo=1,
                data_gradient=True, weight_gradient=True, fully_connected=True),
    ])  # fmt: skip
    w.add(bc.BN_STATS, 1000, "read E")
    w.add(bc.BN_FWD, 1000, "read + write E")
    w.add(bc.BN_FWD, 2000, "recomputed")
    w.add("elementwise", 5000, "additions")
    return w


def test_flops_per_pass_and_the_skipped_data_gradient() -> None:
    w = _workload()
    assert w.convs[0].flops == 2 * 2 * 5 * 5 * 8 * (4 // 2) * 9 == 14400
    assert w.convs[1].flops == 2 * 2 * 10 * 8 == 320
    assert bc.conv_flops(w.convs) == {
        bc.CONV_FWD: 14400, bc.CONV_DGRAD: 0, bc.CONV_WGRAD: 14400, bc.GEMM: 3 * 320
    }  # fmt: skip
    assert w.traffic[bc.BN_FWD] == 3000 and w.notes[bc.BN_FWD] == ["read + write E", "recomputed"]
    again = [dataclasses.replace(c, recomputed=True) for c in w.convs]  # a forward more each
    assert bc.conv_flops(again) == {
        bc.CONV_FWD: 2 * 14400, bc.CONV_DGRAD: 0, bc.CONV_WGRAD: 14400, bc.GEMM: 4 * 320
    }  # fmt: skip


def test_floors_are_flops_over_peak_and_bytes_over_bandwidth() -> None:
    peak = 14400 / 1e-3 / 1e12  # TFLOP/s: the forward's 14400 FLOPs take 1 ms
    bandwidth = 1000 / 0.5e-3 / 1e9  # GB/s: 1000 B take 0.5 ms
    fl = bc.floors(_workload(), peak, bandwidth)
    assert fl[bc.CONV_FWD].ms == pytest.approx(1.0)
    assert fl[bc.CONV_WGRAD].ms == pytest.approx(1.0)
    assert bc.CONV_DGRAD not in fl  # no data gradient: no floor
    assert fl[bc.GEMM].ms == pytest.approx(960 / 14400)
    assert fl[bc.BN_STATS].ms == pytest.approx(0.5)
    assert fl[bc.BN_FWD].ms == pytest.approx(1.5)
    assert fl["elementwise"].ms == pytest.approx(2.5) and not fl["elementwise"].derived
    assert fl["batch norm"].ms == pytest.approx(2.0) and fl["batch norm"].derived
    assert fl["convolution"].ms == pytest.approx(2.0) and fl["convolution"].derived
    # the groups' sums are not counted twice
    assert bc.total_floor(fl) == pytest.approx(2.0 + 960 / 14400 + 2.0 + 2.5)
    assert "GFLOP @" in fl[bc.CONV_FWD].basis and "GB/s" in fl[bc.BN_FWD].basis


def test_summary_rows_and_table_of_a_synthetic_profile() -> None:
    fprop = next(n for n, c in NAMES.items() if c == bc.CONV_FWD)
    steps = 2
    kernels = [(fprop, 2000.0)] * steps + [("_stats_partial", 500.0)] * (2 * steps)
    kernels += [("_forward", 1000.0)] * steps + [("mystery", 1000.0)] * steps
    per_cat = bd.summarize(kernels, steps)
    assert per_cat[bc.CONV_FWD]["ms"] == pytest.approx(2.0)
    assert per_cat[bc.BN_STATS]["launches"] == pytest.approx(2.0)
    assert per_cat[bc.OTHER]["kernels"] == {"mystery": pytest.approx(1.0)}
    fl = bc.floors(_workload(), 14400 / 1e-3 / 1e12, 1000 / 0.5e-3 / 1e9)
    rows = {r.category: r for r in bd.rows(per_cat, fl)}
    fwd = rows[bc.CONV_FWD]
    assert (fwd.ms, fwd.pct, fwd.launches, fwd.ratio) == pytest.approx((2.0, 40.0, 1.0, 2.0))
    bn = rows["batch norm (all)"]
    assert bn.group and (bn.ms, bn.launches, bn.floor_ms) == pytest.approx((2.0, 3.0, 2.0))
    assert rows["elementwise (all)"].ms is None and rows["elementwise (all)"].ratio is None
    assert rows[bc.CONV_WGRAD].ms is None  # a floor, nothing measured
    total = rows["total"]
    assert (total.ms, total.pct, total.launches) == pytest.approx((5.0, 100.0, 5.0))
    assert total.floor_ms == pytest.approx(bc.total_floor(fl))
    assert total.ratio == pytest.approx(5.0 / bc.total_floor(fl))
    lines = bd.table(bd.rows(per_cat, fl)).splitlines()
    assert lines[0].startswith("| category | ms/step | % | launches | floor ms |")
    assert f"| {bc.CONV_FWD} | 2.000 | 40.0 | 1 | 1.000 |" in "\n".join(lines)
    assert any(line.startswith("| **total** | 5.000 | 100.0 | 5 |") for line in lines)
    assert all(r.ms is None for r in bd.rows(None, fl))  # the CPU run: floors only


def _twin_shapes(batch: int) -> tuple[list[tuple[nn.Module, torch.Size]], int]:
    """(module, output shape) of every convolution, linear and batch norm of the twin."""
    twin = ResNet18Twin(3, 10, 64)
    seen: list[tuple[nn.Module, torch.Size]] = []
    for mod in twin.modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)):
            mod.register_forward_hook(lambda m, i, o: seen.append((m, o.shape)))
    with torch.no_grad():
        twin(torch.randn(batch, 3, 32, 32))
    return seen, sum(p.numel() for p in twin.parameters())


def test_cpu_smoke_run_counts_resnet18_as_its_twin(tmp_path, capsys) -> None:
    out = tmp_path / "breakdown.json"
    got = bd.main(["--device", "cpu", "--batch", "2", "--json", str(out)])
    assert json.loads(out.read_text())["flops"] == got["flops"]
    seen, parameters = _twin_shapes(2)
    conv = [2 * s.numel() * m.in_channels * m.kernel_size[0] * m.kernel_size[1]
            for m, s in seen if isinstance(m, nn.Conv2d)]  # fmt: skip
    fc = sum(2 * s.numel() * m.in_features for m, s in seen if isinstance(m, nn.Linear))
    bn = sum(s.numel() for m, s in seen if isinstance(m, nn.BatchNorm2d))
    assert got["flops"] == {
        bc.CONV_FWD: sum(conv) + conv[0],  # the stem runs again before the backward
        bc.CONV_DGRAD: sum(conv) - conv[0],  # the first layer's data gradient is skipped
        bc.CONV_WGRAD: sum(conv),
        bc.GEMM: 3 * fc,
    }
    assert got["parameters"] == parameters == 11173962
    assert got["bytes"][bc.BN_STATS] == 2 * bn  # bfloat16: 2 B per element
    assert got["bytes"][bc.BN_SUMS] == 2 * 2 * bn
    assert got["bytes"][bc.BN_BWD] == 3 * 2 * bn
    assert got["bytes"][bc.OPTIMIZER] == parameters * (16 + 2 + 2)
    assert got["bytes"][bc.BN_FWD] > 2 * 2 * bn  # recomputed results move more
    assert got["bytes"]["elementwise"] > 0
    assert got["rows"][-1]["category"] == "total" and got["rows"][-1]["floor_ms"] > 0
    printed = capsys.readouterr().out
    assert "| **total** | — | — | — |" in printed and "# FLOPs per step:" in printed
