"""The grad scores' fused RMSNorms (`scores.norm`): which modules are norms, the rule that decides
whether a class is fused, and the kernels against transformers' own norms (under the Triton
interpreter on CPU tensors, and on a GPU)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from resserve_export.algorithms.scores import norm as NM
from tests.fixtures.kernels_triton import gpu_kernels, no_gpu, run_interpreted


class OddRMSNorm(nn.Module):
    """Named like a norm, computes something else: must keep its own forward."""

    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        return (2 * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight.float()).to(x.dtype)


def _norm(cls_name: str, n: int, dtype, seed: int = 0):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    cls = {"qwen3": Qwen3RMSNorm, "gemma3": Gemma3RMSNorm, "odd": OddRMSNorm}[cls_name]
    torch.manual_seed(seed)
    m = cls(n).to(dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(n) * 0.3 + (0.0 if cls_name == "gemma3" else 1.0))
    m.weight.requires_grad_(False)
    return m


def _tiny(family: str, dtype=torch.bfloat16, device="cpu"):
    """A tiny random model of `family` (qwen3: Llama-form norms, q/k norms too; gemma3: Gemma's)."""
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if family == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16))
        with torch.no_grad():  # Gemma's norm weights start at 0: give them a spread
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.normal_(0, 0.3)
    return model.to(dtype=dtype, device=device).eval()


def _loss_and_grad(model, ids):
    """The scores' pass in small: loss and the input embeddings' gradient, weights frozen."""
    for p in model.parameters():
        p.requires_grad_(False)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=emb, use_cache=False).logits
    loss = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).sum()
    loss.backward()
    return loss.detach(), emb.grad


def _ulps_and_share(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(largest difference in units of b's dtype's eps·|b|, share of bit-identical elements)."""
    af, bf = a.float(), b.float()
    ulp = torch.finfo(b.dtype).eps * bf.abs() + torch.finfo(b.dtype).tiny
    return float(((af - bf).abs() / ulp).max()), float((af == bf).float().mean())


def test_norms_are_found_by_class_name_weight_and_eps():
    assert NM._eps_of(_norm("qwen3", 8, torch.float32)) == 1e-6
    assert NM._eps_of(_norm("gemma3", 8, torch.float32)) == 1e-6
    assert NM._eps_of(nn.LayerNorm(8)) is None  # not an RMSNorm
    assert NM._eps_of(nn.Linear(8, 8)) is None
    odd = _norm("odd", 8, torch.float32)
    del odd.variance_epsilon
    assert NM._eps_of(odd) is None  # no ε it could use


def test_agreement_rule():
    """Fused only within two ulps everywhere and bit for bit on ≥ 99% of the elements."""
    want = torch.linspace(0.5, 8, 1000).bfloat16()
    assert NM.agrees(want.clone(), want)
    one_off = want.clone()
    one_off[:5] = (want[:5].float() * (1 + 2**-7)).bfloat16()  # 0.5%: one step each
    assert NM.agrees(one_off, want)
    many = want.clone()
    many[:50] = (want[:50].float() * (1 + 2**-7)).bfloat16()  # 5%
    assert not NM.agrees(many, want)
    far = want.clone()
    far[0] = want[0] * 1.05  # one element, several steps away
    assert not NM.agrees(far, want)
    assert not NM.agrees(want.half(), want) and not NM.agrees(want[:10], want)


def test_exact_mode_checks_send_a_class_back_on_a_mismatch():
    """The exact mode's in-place checks (`norm._Checks`): an output or a gradient that is not the
    eager one bit for bit sends the class back to its own forward, and the call that found it
    takes the eager result; a matching one is checked once per width/dtype or gradient layout."""
    m = _norm("qwen3", 16, torch.bfloat16)
    x = (torch.randn(3, 4, 16) * 2).bfloat16()
    dy = torch.randn(3, 4, 16).bfloat16()
    xw = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(m(xw), xw, dy)
    cls = type(m)
    forms = {cls: "llama"}
    checks = NM._Checks(forms)
    check = checks.backward(cls, m.forward)
    assert check(x, dy, want) is want and forms[cls] == "llama"  # matches: kept, and remembered
    wrong = want.clone()
    wrong.view(-1)[5] = wrong.view(-1)[5] * 2 + 1
    assert check(x, dy, wrong) is wrong  # this layout was checked already
    other = dy.transpose(0, 1).contiguous().transpose(0, 1)  # a new layout: checked, found wrong
    got = check(x, other, wrong)
    assert torch.equal(got, want) and forms[cls] is None
    forms[cls] = "llama"
    assert torch.equal(check(x, dy, None), want) and forms[cls] is None  # the kernel raised: eager, and back to its own
    forms[cls] = "llama"
    y = m(x)
    assert checks.output(cls, x, y, m.forward) is y and forms[cls] == "llama"
    bad = y.clone()
    bad.view(-1)[0] = bad.view(-1)[0] + 1
    assert checks.output(cls, x, bad, m.forward) is bad  # this width and dtype were checked already
    assert checks.output(cls, x[..., :8].contiguous(), bad[..., :8], _norm("qwen3", 8, torch.bfloat16).forward) is None
    assert forms[cls] is None
    assert NM.identical(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))
    assert not NM.identical(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0 + 2**-20]))


def test_fused_norm_refuses_what_its_kernels_do_not_cover():
    """FP32 input, a llama-form weight of another dtype, or a width that is not the weight's: one
    ValueError before any kernel is launched (a CPU tensor suffices)."""
    m = _norm("qwen3", 16, torch.bfloat16)
    for x, w in ((torch.randn(3, 16), m.weight.float()), (torch.randn(3, 16).bfloat16(), m.weight.float()), (torch.randn(3, 8).bfloat16(), m.weight)):
        with pytest.raises(ValueError, match="covers bf16/fp16 inputs"):
            NM.fused_rms_norm(x, w, 1e-6, "llama")


@pytest.mark.parametrize("flag", ["0", "1"])
def test_nothing_is_swapped_where_the_kernels_do_not_run(flag, monkeypatch):
    """On CPU tensors without the interpreter, or when not asked for, the model keeps its own norms."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("RESSERVE_FUSED_NORM", flag)
    model = _tiny("qwen3")
    with NM.fused_norms(model) as forms:
        assert forms is None
        assert not any("forward" in m.__dict__ for m in model.modules())


def _interpreted_check() -> None:
    """Run under ``TRITON_INTERPRET=1`` with ``RESSERVE_FUSED_NORM`` set (before Triton is first imported)."""
    _kernel_cases("cpu")
    _model_cases("cpu")


def _kernel_cases(device: str) -> None:
    """Each form against transformers' own norm: output and input gradient within two ulps and bit
    for bit on ≥ 99% (on CPU they come out identical in bf16), rows of 128 and of 96 (masked lanes)."""
    for name, form in (("qwen3", "llama"), ("gemma3", "gemma")):
        for dtype in (torch.bfloat16, torch.float16):
            for n in (128, 96):
                m = _norm(name, n, dtype).to(device)
                x = (torch.randn(37, n) * 3).to(dtype).to(device).requires_grad_(True)
                want = m(x)
                dy = torch.randn_like(want)
                (gx_want,) = torch.autograd.grad(want, x, dy)
                eps = m.variance_epsilon if name == "qwen3" else m.eps
                y = NM.fused_rms_norm(x, m.weight, eps, form)
                (gx,) = torch.autograd.grad(y, x, dy)
                # The backward kernel behind the module's own forward: its output bits, and the
                # gradient by the same rule (1/rms recomputed in the kernel).
                yb = NM._apply(x, m.weight, eps, form, m.forward, "backward")
                (gxb,) = torch.autograd.grad(yb, x, dy)
                assert torch.equal(yb, want)
                for got, ref in ((y, want), (gx, gx_want), (gxb, gx_want)):
                    ulps, share = _ulps_and_share(got.detach(), ref.detach())
                    assert got.dtype == ref.dtype and ulps <= 2 and share >= 0.99, (name, dtype, n, ulps, share)
                for how in ("all", "backward", "exact"):
                    assert NM._form_of(m.weight, eps, x, m.forward, how) == form
                # The exact mode: the eager chain's bits, forward and backward, also for a 4-D input
                # whose output gradient comes in another layout (as Qwen3's q/k norms get it).
                x4 = (torch.randn(2, 5, 3, n) * 3).to(dtype).to(device).requires_grad_(True)
                dy4 = torch.randn(2, 3, 5, n).to(dtype).to(device).transpose(1, 2)
                for xi, dyi in ((x, dy), (x4, dy4), (x4, dy4.contiguous())):
                    want_i = m(xi)
                    (gw,) = torch.autograd.grad(want_i, xi, dyi)
                    got_i = NM._apply(xi, m.weight, eps, form, m.forward, "exact")
                    (ge,) = torch.autograd.grad(got_i, xi, dyi)
                    assert torch.equal(got_i, want_i) and torch.equal(ge, gw), (name, dtype, n, tuple(xi.shape))
                # The other form is not this norm: the rule refuses it.
                other = "gemma" if form == "llama" else "llama"
                with torch.no_grad():
                    assert not NM.agrees(NM.fused_rms_norm(x, m.weight, 1e-6, other), want.detach())
    with pytest.raises(ValueError, match="unknown RMSNorm form"):
        NM.fused_rms_norm(x, m.weight, 1e-6, "t5")


def _deterministic_attention():
    """PyTorch's math attention: its backward sums in a fixed order (the fused attention kernels'
    backward on a GPU need not), so two passes can be compared bit for bit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _model_cases(device: str) -> None:
    """A whole tiny model under `fused_norms` (in the environment's `mode`): the right form per
    class, the loss and the input gradient of the scores' pass as with the model's own norms, and
    the norms restored after. With ``backward`` the forward is the model's own, so the loss is
    the same bits."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    how = NM.mode()
    assert how in ("all", "backward", "exact")
    for family, cls_name, form in (("qwen3", "Qwen3RMSNorm", "llama"), ("gemma3", "Gemma3RMSNorm", "gemma")):
        model = _tiny(family, device=device)
        with _deterministic_attention() if how == "exact" else contextlib.nullcontext():
            want = _loss_and_grad(model, ids)
            with NM.fused_norms(model) as forms:
                got = _loss_and_grad(model, ids)
        assert {c.__name__: f for c, f in forms.items()} == {cls_name: form}
        assert not any("forward" in m.__dict__ for m in model.modules())
        if how == "exact":  # the eager chain's bits: the same loss and input gradient
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), family
            # A backward kernel that cannot run: the eager gradient, and the class back to its own.
            real = NM._exact_backward
            NM._exact_backward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no kernel here"))
            try:
                with _deterministic_attention(), NM.fused_norms(model) as forms:
                    again = _loss_and_grad(model, ids)
            finally:
                NM._exact_backward = real
            assert torch.equal(again[1], want[1]) and forms == {type(next(m for m in model.modules() if type(m).__name__ == cls_name)): None}
            continue
        if how == "backward":
            assert torch.equal(got[0], want[0])
        assert math.isclose(float(got[0]), float(want[0]), rel_tol=1e-3)
        ulps, share = _ulps_and_share(got[1], want[1])
        assert share >= (0.95 if how == "backward" else 0.9), (family, how, ulps, share)
        torch.testing.assert_close(got[1].float(), want[1].float(), rtol=0.02, atol=1e-3 * float(want[1].float().abs().max()))
    # A class that only looks like a norm keeps its own forward (and its output).
    odd = nn.Sequential(_norm("odd", 64, torch.bfloat16)).to(device)
    x = torch.randn(5, 64).bfloat16().to(device)
    with NM.fused_norms(odd) as forms:
        y = odd(x)
    assert forms == {OddRMSNorm: None} and torch.equal(y, odd(x))


@no_gpu
@pytest.mark.parametrize("how", ["1", "backward", "exact"])
def test_fused_norm_kernels_logic_under_the_triton_interpreter(how):
    """The kernels and the swap on CPU tensors, in a fresh interpreter with ``TRITON_INTERPRET=1``,
    both modes. Skipped where Triton is not installed (CPU-only torch does not bring it)."""
    run_interpreted("tests.algorithms.test_norm", RESSERVE_FUSED_NORM=how)


triton_gpu = gpu_kernels(NM.available)


@pytest.mark.gpu
@triton_gpu
@pytest.mark.parametrize("how", ["1", "backward", "exact"])
def test_gpu_fused_norms_give_the_eager_norms(how, monkeypatch):
    """On CUDA: each form against transformers' norms, and whole tiny models under `fused_norms`."""
    monkeypatch.setenv("RESSERVE_FUSED_NORM", how)
    _kernel_cases("cuda")
    _model_cases("cuda")


def assert_fused_scores_as_eager(monkeypatch, switches, rel_tol: float = 2e-4) -> None:
    """compute_scores on a tiny bf16 Qwen3 on the GPU with the environment `switches` all on and
    all off: within `rel_tol` relative (2e-4: the stated tolerance of the bf16 scores).
    `switches`: names (on = ``1``) or ``{name: value when on}``."""
    from resserve_export.algorithms import scores as S
    from resserve_export.modeling.groups import group_linears, linears_of
    from resserve_export.observers.stats import collect

    model = _tiny("qwen3", device="cuda")
    g = torch.Generator().manual_seed(2)
    batches = [{"input_ids": torch.randint(0, 128, (3, 16), generator=g).cuda(), "attention_mask": torch.ones(3, 16, dtype=torch.long).cuda()} for _ in range(2)]
    groups = group_linears(linears_of(model))
    stats, _ = collect(model, batches, groups)
    on = switches if isinstance(switches, dict) else {name: "1" for name in switches}
    runs = {}
    for flag in ("0", "1"):
        for name, value in on.items():
            monkeypatch.setenv(name, value if flag == "1" else "0")
        runs[flag] = S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision="bf16")
    for a, e in zip(runs["1"]["groups"], runs["0"]["groups"]):
        for k, v in e["scores"].items():
            assert v > 0 and math.isclose(a["scores"][k], v, rel_tol=rel_tol), (a["modules"], k)


@pytest.mark.gpu
@triton_gpu
@pytest.mark.parametrize("how", ["1", "backward"])
def test_gpu_fused_norms_give_the_eager_scores(how, monkeypatch):
    """The scores with the RMSNorms fused (both modes) and eager (`assert_fused_scores_as_eager`)."""
    assert_fused_scores_as_eager(monkeypatch, {"RESSERVE_FUSED_NORM": how})


@pytest.mark.gpu
@triton_gpu
def test_gpu_exact_norms_give_the_eager_scores_bit_for_bit(monkeypatch):
    """The default mode keeps the eager norms' bits, so the scores are the eager ones exactly
    (with PyTorch's math attention, whose backward is deterministic)."""
    with _deterministic_attention():
        assert_fused_scores_as_eager(monkeypatch, {"RESSERVE_FUSED_NORM": "exact"}, rel_tol=0.0)


def test_exact_norms_launch_from_the_extension_only_when_asked(monkeypatch):
    """`RESSERVE_NORM_LAUNCH=extension` is opt-in, and only for CUDA tensors where the extension
    can build; CPU tensors keep the Triton kernels (the interpreter's path)."""
    from resserve_export.algorithms import kernel

    monkeypatch.delenv("RESSERVE_NORM_LAUNCH", raising=False)
    monkeypatch.setattr(kernel, "KERNEL_AVAILABLE", True)
    cpu = torch.zeros(2, 8)
    assert not NM._from_extension(cpu)
    monkeypatch.setenv("RESSERVE_NORM_LAUNCH", "extension")
    assert not NM._from_extension(cpu)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert NM._from_extension(cpu)
    monkeypatch.setattr(kernel, "KERNEL_AVAILABLE", False)
    assert not NM._from_extension(cpu)


ext_gpu = pytest.mark.skipif(
    not __import__("resserve_export.algorithms.kernel").algorithms.kernel.KERNEL_AVAILABLE,
    reason="needs a CUDA GPU and nvcc for the project's CUDA extension",
)


@pytest.mark.gpu
@triton_gpu
@ext_gpu
def test_gpu_exact_norms_launched_from_the_extension_give_the_eager_bits(monkeypatch):
    """``RESSERVE_NORM_LAUNCH=extension``: the exact mode's steps from kernels/rms_norm.cu give
    transformers' norms bit for bit (both forms, bf16 and fp16, 2-D and 4-D inputs, a transposed
    output gradient), whole tiny models their loss and input gradient, and the scores the eager
    ones exactly; the extension is what ran."""
    from resserve_export.algorithms import kernel

    monkeypatch.setenv("RESSERVE_FUSED_NORM", "exact")
    monkeypatch.setenv("RESSERVE_NORM_LAUNCH", "extension")
    calls = []
    for name in ("norm_square", "norm_output", "norm_backward"):
        real = getattr(kernel, name)
        monkeypatch.setattr(kernel, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    _kernel_cases("cuda")
    _model_cases("cuda")
    assert {"norm_square", "norm_output", "norm_backward"} <= set(calls)
    with _deterministic_attention():
        assert_fused_scores_as_eager(monkeypatch, {"RESSERVE_FUSED_NORM": "exact", "RESSERVE_NORM_LAUNCH": "extension"}, rel_tol=0.0)
