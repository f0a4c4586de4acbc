"""The contract every torch.ops.bastile op keeps, checked on the CONTRACT of each op's test file
(conftest.Contract): opcheck of the op and of every bastile op its forward and backward call, gradcheck,
torch.compile, TorchScript, empty, bad and non-contiguous inputs, no_grad and inference_mode, double
backward, the CPU kernels on torch's threads (forked DataLoader workers, one thread), and on CUDA side
streams and graph capture; the autograd checks for the differentiable ops, a refused backward for the
others. What is particular to an op stays in its file."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from conftest import DEVICES, needs_cuda


def contracts():
    """Every CONTRACT of the other tests/test_*.py modules, by op name."""
    found = {}
    here = Path(__file__).resolve()
    for path in sorted(here.parent.glob("test_*.py")):
        if path == here:
            continue
        try:
            module = importlib.import_module(path.stem)
        except pytest.skip.Exception:  # a module of tests that need what is not installed here (TRL)
            continue
        if hasattr(module, "CONTRACT"):
            found[module.CONTRACT.op.__name__] = module.CONTRACT
    return found


CONTRACTS = contracts()
OPS = list(CONTRACTS)
DIFFERENTIABLE = [name for name in OPS if CONTRACTS[name].differentiable]


def tensors(call):
    return [t for t in tree_flatten(call)[0] if isinstance(t, torch.Tensor)]


def requiring_grad(call):
    return [t for t in tensors(call) if t.requires_grad]


def fresh(args):
    """Leaves with the values, layout and requires_grad of args' tensors, so that no two runs share one."""
    return tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t,
                    args)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def cotangents(outs):
    """A fixed random gradient for each floating output (None for the others)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device) if o.is_floating_point() else None
            for o in outs]


def differentiated(outs, grad_outs):
    """The outputs autograd differentiates (not those an op marks non-differentiable), and their gradients."""
    pairs = [(o, g) for o, g in zip(outs, grad_outs) if o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def forward_backward(fn, args, kwargs, grad_outs=None):
    """fn's outputs, and the gradients of those of args that require grad for grad_outs (one per output;
    default: cotangents(outputs))."""
    outs = as_tuple(fn(*args, **kwargs))
    outs_d, grad_outs = differentiated(outs, grad_outs or cotangents(outs))
    grads = torch.autograd.grad(outs_d, requiring_grad((args, kwargs)), grad_outs) if outs_d else []
    return [o.detach() for o in outs], list(grads)


def assert_equal(got, want):
    """Bitwise equal, tensor by tensor, in shape and dtype too."""
    got, want = tensors(got), tensors(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class Recorder(TorchDispatchMode):
    """Records each bastile op called below autograd, with copies of its arguments as they were at the call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "bastile":
            # Copies: flce's backward scales the saved gradients it was handed in place.
            copy = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t
            self.calls.append((func, *tree_map(copy, (args, kwargs))))
        return func(*args, **kwargs)


def pieces(contract, args, kwargs):
    """(op, args, kwargs) of every bastile op that the op's forward and backward call."""
    recorder = Recorder()
    args = fresh(args)
    with recorder:
        outs = as_tuple(contract.op(*args, **kwargs))
        # retain_graph: else flce's backward scales its saved gradients itself, without its _backward op.
        outs, grad_outs = differentiated(outs, cotangents(outs))
        if outs:
            torch.autograd.grad(outs, requiring_grad((args, kwargs)), grad_outs, retain_graph=True)
    return recorder.calls


def assert_fake_strides(op, args, kwargs):
    """The fake (Meta) kernel's outputs have the real ones' strides, which opcheck leaves unchecked and
    torch.compile relies on."""
    real = tensors(op(*args, **kwargs))
    with FakeTensorMode() as mode:
        fake = tensors(op(*tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, args),
                          **kwargs))
    assert [t.stride() for t in fake] == [t.stride() for t in real], op


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, device):
    contract = CONTRACTS[name]
    for args, kwargs in contract.samples(device):
        torch.library.opcheck(contract.op.default, fresh(args), kwargs)
        assert_fake_strides(contract.op.default, fresh(args), kwargs)
        for op, op_args, op_kwargs in pieces(contract, args, kwargs):
            torch.library.opcheck(op, op_args, op_kwargs)
            assert_fake_strides(op, op_args, op_kwargs)


def test_every_op_has_a_contract():
    """Each bastile op on tensors is some CONTRACT's op or called by one, so the tests here reach it."""
    reached = set()
    for contract in CONTRACTS.values():
        reached.add(contract.op.default.name())
        for args, kwargs in contract.samples("cpu"):
            reached |= {op.name() for op, _, _ in pieces(contract, args, kwargs)}
    ops = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("bastile::")}
    on_tensors = {name for name in ops if "Tensor" in str(torch._C._get_schema(name, ""))}
    assert on_tensors == reached, on_tensors ^ reached


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_pieces_are_not_differentiable(name, device):
    """The forward and backward ops the autograd node calls raise on backward instead of leaving a
    gradient silently missing."""
    contract = CONTRACTS[name]
    args, kwargs = contract.samples(device)[0]
    for op, op_args, op_kwargs in pieces(contract, args, kwargs):
        if op.overloadpacket is contract.op:
            continue
        op_args, op_kwargs = tree_map(
            lambda t: t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            (op_args, op_kwargs))
        outs = [o for o in as_tuple(op(*op_args, **op_kwargs)) if o.requires_grad]
        assert outs, op
        with pytest.raises(RuntimeError, match="is not implemented"):
            torch.autograd.backward([o.sum() for o in outs])


def test_samples_require_grad_where_the_op_differentiates():
    for name, contract in CONTRACTS.items():
        for call in contract.samples("cpu"):
            assert bool(requiring_grad(call)) == contract.differentiable, name


# The ops without an autograd node that take a floating tensor (expert_group takes indices only).
FROZEN = sorted(name for name in set(OPS) - set(DIFFERENTIABLE)
                if any(t.is_floating_point() for t in tensors(CONTRACTS[name].samples("cpu")[0])))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FROZEN)
def test_frozen_ops_refuse_backward(name, device):
    """An op without an autograd node, called on a floating input that requires grad: its backward raises
    instead of leaving that gradient silently missing."""
    args, kwargs = CONTRACTS[name].samples(device)[0]
    args = tree_map(lambda t: t.detach().clone().requires_grad_(t.is_floating_point())
                    if isinstance(t, torch.Tensor) else t, args)
    outs = [o for o in as_tuple(CONTRACTS[name].op(*args, **kwargs)) if o.requires_grad]
    assert outs
    with pytest.raises(RuntimeError, match="is not implemented"):
        torch.autograd.backward([o.sum() for o in outs])


def to_float64(call):
    return tree_map(lambda t: t.detach().double().requires_grad_(t.requires_grad)
                    if isinstance(t, torch.Tensor) and t.is_floating_point() else t, call)


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradcheck_fp64(name):
    contract = CONTRACTS[name]
    samples = contract.gradcheck_samples() if contract.gradcheck_samples else map(to_float64, contract.samples("cpu"))
    for args, kwargs in samples:
        inputs = requiring_grad((args, kwargs))
        assert inputs and all(t.dtype == torch.float64 for t in inputs)

        def f(*xs):
            swap = dict(zip(map(id, inputs), xs))
            a, k = tree_map(lambda t: swap.get(id(t), t), (args, kwargs))
            return tuple(o for o in as_tuple(contract.op(*a, **k)) if o.requires_grad)

        # Central differences in float64 are good to ~1e-10 here; gradcheck's defaults (atol 1e-5, rtol
        # 1e-3) would let a 0.1% error in a gradient through.
        assert torch.autograd.gradcheck(f, inputs, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", OPS)
def test_torch_compile_matches_eager(name, dynamic, device):
    contract = CONTRACTS[name]
    torch._dynamo.reset()

    def f(*args, **kwargs):
        return contract.op(*args, **kwargs)

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    samples = contract.samples(device)
    assert [t.shape for t in tensors(samples[0])] != [t.shape for t in tensors(samples[1])]
    for i, (args, kwargs) in enumerate(samples):
        # Dynamic: the first two samples, one call at two sizes, share a graph; the others recompile.
        with torch._dynamo.config.patch(error_on_recompile=dynamic and i == 1):
            # The compiled graph calls the op's forward and backward ops, as its autograd node does.
            assert_equal(forward_backward(compiled, fresh(args), kwargs), forward_backward(f, fresh(args), kwargs))


def scripted(op):
    """A TorchScript function taking the op's arguments, typed from its schema, and calling it."""
    schema = op.default._schema
    params = ", ".join(f"{a.name}: {a.type.annotation_str}" for a in schema.arguments)
    names = ", ".join(a.name for a in schema.arguments)
    source = f"def call({params}):\n    return torch.ops.{schema.name.replace('::', '.')}({names})\n"
    return torch.jit.CompilationUnit(source).call


def positional(op, args, kwargs):
    """args and kwargs as the op's full list of arguments, defaults included."""
    return [args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
            for i, a in enumerate(op.default._schema.arguments)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_torchscript(name, device):
    contract = CONTRACTS[name]
    call = scripted(contract.op)
    for args, kwargs in contract.samples(device):
        assert_equal(forward_backward(call, fresh(positional(contract.op, args, kwargs)), {}),
                     forward_backward(contract.op, fresh(args), kwargs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_empty_input(name, device):
    contract = CONTRACTS[name]
    for args, kwargs in contract.empty(device):
        assert any(t.numel() == 0 for t in tensors(args))
        outs, grads = forward_backward(contract.op, fresh(args), kwargs)
        assert [g.shape for g in grads] == [t.shape for t in requiring_grad((args, kwargs))]
        # Shapes, dtypes and values (a weight's gradient is zero, a mean over no rows is the op's own
        # choice, which the reference states) as the reference's.
        assert_equal((outs, grads), forward_backward(contract.reference, fresh(args), kwargs))


BAD = [(name, i) for name, contract in CONTRACTS.items() for i in range(len(contract.bad))]


@pytest.mark.parametrize("name,i", BAD, ids=[f"{name}-{i}" for name, i in BAD])
def test_bad_input_raises(name, i):
    call, pattern = CONTRACTS[name].bad[i]
    with pytest.raises(RuntimeError, match=pattern):
        call()


def strided(t, layout):
    """t's values and requires_grad in a view of a larger buffer. "rows": every dimension padded, the
    last stride still 1 (as HF's transposes and slices of fused projections); "elements": every
    stride doubled, the last too. The padding (8 elements) keeps each stride's remainder modulo 16
    bytes, so CUDA kernels that pick their vector width from it pick the same as for t."""
    if layout == "rows":
        view = torch.empty([n + 8 for n in t.shape], dtype=t.dtype, device=t.device)[tuple(map(slice, t.shape))]
    else:
        view = torch.empty([*t.shape, 2], dtype=t.dtype, device=t.device)[..., 0]
    with torch.no_grad():
        view.copy_(t)
    return view.requires_grad_(t.requires_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["rows", "elements"])
@pytest.mark.parametrize("name", OPS)
def test_non_contiguous_inputs(name, layout, device):
    contract = CONTRACTS[name]
    for args, kwargs in contract.samples(device):
        outs, grads = forward_backward(contract.op, fresh(args), kwargs)
        s_args, s_kwargs = tree_map(lambda t: strided(t, layout) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        # Every tensor that can be: more than one row ("rows" leaves a single row dense) or element.
        assert not any(t.is_contiguous() for t in tensors(s_args)
                       if t.numel() > (t.shape[-1:].numel() if layout == "rows" else 1))
        s_grad_outs = [None if c is None else strided(c, layout) for c in cotangents(outs)]
        assert_equal(forward_backward(contract.op, s_args, s_kwargs, s_grad_outs), (outs, grads))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_expanded_output_gradients(name, device):
    """An output's .sum() hands the backward a stride-0 gradient: the same as the materialised one."""
    contract = CONTRACTS[name]
    for args, kwargs in contract.samples(device):
        args = fresh(args)
        outs = as_tuple(contract.op(*args, **kwargs))
        expanded = torch.autograd.grad(sum(o.sum() for o in outs if o.requires_grad), requiring_grad((args, kwargs)))
        assert_equal(expanded, forward_backward(contract.op, fresh(args), kwargs,
                                                [torch.ones_like(o) for o in outs])[1])


def saving(saved):
    """Collects what autograd saves for backward."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_no_grad_and_inference_mode_match_autograd_path(name, device):
    contract = CONTRACTS[name]
    for args, kwargs in contract.samples(device):
        args, saved = fresh(args), []
        with saving(saved):
            outs = as_tuple(contract.op(*args, **kwargs))
        assert saved and any(o.grad_fn is not None for o in outs)  # the hooks see what the autograd path saves
        saved.clear()
        with torch.no_grad(), saving(saved):
            no_grad = as_tuple(contract.op(*args, **kwargs))
        assert not saved
        with torch.inference_mode():
            inference = as_tuple(contract.op(*args, **kwargs))
        assert all(o.grad_fn is None for o in no_grad + inference)
        assert_equal(no_grad, outs)
        assert_equal(inference, outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_double_backward_is_refused(name, device):
    contract = CONTRACTS[name]
    args, kwargs = contract.samples(device)[0]
    args = fresh(args)
    outs = as_tuple(contract.op(*args, **kwargs))
    outs, grad_outs = differentiated(outs, cotangents(outs))
    grads = torch.autograd.grad(outs, requiring_grad((args, kwargs)), grad_outs, create_graph=True)
    # The backward ops are not differentiable; flce's gradients, made in its forward, have no graph at all.
    with pytest.raises(RuntimeError, match="is not implemented|does not require grad"):
        torch.autograd.backward([g.sum() for g in grads])


class EveryCpuOp(torch.utils.data.Dataset):
    """Each item: the outputs of every op and of the pieces its forward and backward call, on each CPU sample.
    They are called directly, not through autograd: a forked child cannot run torch's autograd engine
    once its parent has, with or without Bastile."""

    def __init__(self):
        detached = lambda call: tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, call)
        self.calls = [call for c in CONTRACTS.values() for args, kwargs in c.samples("cpu")
                      for call in [(c.op, *detached((args, kwargs)))] + pieces(c, args, kwargs)]

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return [op(*fresh(args), **kwargs) for op, args, kwargs in self.calls]


def test_cpu_ops_run_in_forked_dataloader_workers():
    """The parent runs every CPU kernel, then forked DataLoader workers (one torch thread each, as DataLoader
    sets) run them again and get what the parent gets with one thread (ATen's GEMMs in the cross-entropy
    sum in another order with more); a kernel waiting on threads fork() did not copy would hang the
    workers past the timeout. The parent's first run takes two threads whatever the process was given
    (OMP_NUM_THREADS=1 would start no pool), so that the pool exists when the workers fork."""
    data = EveryCpuOp()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        data[0]
        torch.set_num_threads(1)
        want = data[0]
    finally:
        torch.set_num_threads(threads)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2, multiprocessing_context="fork",
                                         timeout=60)
    for got in loader:
        assert_equal(got, want)


def test_one_torch_thread_starts_no_thread():
    """Under torch.set_num_threads(1) the CPU kernels run on the calling thread, as torch's own ops do: the
    process has the threads it had after a plain torch forward and backward."""
    script = """
import os, torch
torch.set_num_threads(1)
import test_contract as t
threads = lambda: len(os.listdir("/proc/self/task"))
x = torch.randn(64, 64, requires_grad=True)
torch.autograd.grad(x.mm(x).sigmoid().sum(), x)
before = threads()
for contract in t.CONTRACTS.values():
    for args, kwargs in contract.samples("cpu"):
        t.forward_backward(contract.op, t.fresh(args), kwargs)
print(before, threads())
"""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=here, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    before, after = map(int, run.stdout.split()[-2:])
    assert after == before


@needs_cuda
@pytest.mark.parametrize("name", OPS)
def test_cuda_side_stream_matches_default_stream(name):
    contract = CONTRACTS[name]
    side = torch.cuda.Stream()
    for args, kwargs in contract.samples("cuda"):
        want = forward_backward(contract.op, fresh(args), kwargs)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the backward runs on its forward's stream
            # The inputs hold NaN until a long sleep on `side` is over: a kernel launched on any other
            # stream reads NaN.
            late = tree_map(lambda t: torch.full_like(t, float("nan")) if isinstance(t, torch.Tensor)
                            and t.is_floating_point() else t, args)
            torch.cuda._sleep(100_000_000)
            with torch.no_grad():
                for x, t in zip(tensors(late), tensors(args)):
                    if x is not t:
                        x.copy_(t).requires_grad_(t.requires_grad)
            got = forward_backward(contract.op, late, kwargs)
        torch.cuda.current_stream().wait_stream(side)
        assert_equal(got, want)


def renew_(ts):
    """New values in place: floating tensors drawn afresh, integer ones (targets) permuted so they stay valid."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in ts:
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g))
            else:
                t.copy_(t.flatten()[torch.randperm(t.numel(), generator=g).to(t.device)].view(t.shape))


@needs_cuda
@pytest.mark.parametrize("name", OPS)
def test_cuda_graph_replay_matches_eager(name):
    contract = CONTRACTS[name]
    for args, kwargs in contract.samples("cuda"):
        before = forward_backward(contract.op, fresh(args), kwargs)
        grad_outs = cotangents(before[0])
        # The captured leaves are used on the side stream and in the capture only: a leaf whose gradient
        # autograd once took on the default stream makes that (legacy) stream wait on the capture, which
        # invalidates it (seen under compute-sanitizer).
        args = fresh(args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # first calls (cuBLAS handles, workspaces) before the capture
            forward_backward(contract.op, args, kwargs, grad_outs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = forward_backward(contract.op, args, kwargs, grad_outs)
        renew_(tensors(args))
        graph.replay()
        want = forward_backward(contract.op, fresh(args), kwargs, grad_outs)
        assert not torch.equal(want[0][0], before[0][0]), "the new inputs must change the result"
        assert_equal(captured, want)
