"""Turns numpy arrays and torch CPU tensors into (address, element count, dtype code) for
the C++ SDK, without copying: collectives read and write the caller's memory in place.

Accepted: C-contiguous numpy.ndarray and contiguous torch.Tensor on the CPU, of float16,
bfloat16 (torch only), float32, float64, int8, uint8, int32, int64 or bool; cuda_view() takes
contiguous torch CUDA tensors (docs/gpu.md). Anything else
raises TypeError (not an array, unsupported dtype, CUDA tensor where CPU is needed) or ValueError
(non-contiguous, read-only where the call writes). torch is imported only if the caller
already has: a numpy-only program never pays for it.
"""
import sys

# collserve.v1.DataType values.
_NUMPY = {"float32": 1, "float64": 2, "int32": 3, "int64": 4, "float16": 5, "int8": 7, "uint8": 8, "bool": 9}
_TORCH = {"float32": 1, "float64": 2, "int32": 3, "int64": 4, "float16": 5, "bfloat16": 6, "int8": 7,
          "uint8": 8, "bool": 9}


def _torch_tensor_type():
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def view(t, writable=True, what="tensor"):
    """Returns (address, element count, dtype code) of `t`; raises TypeError/ValueError."""
    tensor_type = _torch_tensor_type()
    if tensor_type is not None and isinstance(t, tensor_type):
        if t.device.type != "cpu":
            raise TypeError(f"{what} is on {t.device}; this call takes CPU tensors (CUDA tensors: "
                            "all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor, "
                            "all_to_all_single, send, recv, isend, irecv, batch_isend_irecv; and with "
                            "collserve.torch_pg gather and scatter)")
        if t.is_sparse:
            raise TypeError(f"{what} is sparse; collserve takes dense tensors")
        name = str(t.dtype).replace("torch.", "")
        code = _TORCH.get(name)
        if code is None:
            raise TypeError(f"{what} has dtype {t.dtype}, which collserve does not support "
                            f"(supported: {', '.join(sorted(_TORCH))})")
        if not t.is_contiguous():
            raise ValueError(f"{what} is not contiguous; pass t.contiguous() and copy the result back")
        return t.data_ptr(), t.numel(), code
    np = sys.modules.get("numpy")
    if np is None or not isinstance(t, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray or a torch.Tensor, got {type(t).__name__}")
    code = _NUMPY.get(t.dtype.name)
    if code is None:
        raise TypeError(f"{what} has dtype {t.dtype}, which collserve does not support "
                        f"(supported: {', '.join(sorted(_NUMPY))})")
    if not t.flags.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous; pass numpy.ascontiguousarray(a) and copy the result back")
    if writable and not t.flags.writeable:
        raise ValueError(f"{what} is read-only, but the call writes to it")
    return t.__array_interface__["data"][0], t.size, code


def cuda_view(t, what="tensor"):
    """(address, element count, dtype code, stream) of a torch CUDA tensor, the stream being the
    tensor's device's current stream (cudaStream_t as an int); None if `t` is not a CUDA tensor.
    Raises TypeError (unsupported dtype, sparse) or ValueError (non-contiguous) as view()."""
    tensor_type = _torch_tensor_type()
    if tensor_type is None or not isinstance(t, tensor_type) or t.device.type != "cuda":
        return None
    if t.is_sparse:
        raise TypeError(f"{what} is sparse; collserve takes dense tensors")
    code = _TORCH.get(str(t.dtype).replace("torch.", ""))
    if code is None:
        raise TypeError(f"{what} has dtype {t.dtype}, which collserve does not support "
                        f"(supported: {', '.join(sorted(_TORCH))})")
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous; pass t.contiguous() and copy the result back")
    torch = sys.modules["torch"]
    return t.data_ptr(), t.numel(), code, torch.cuda.current_stream(t.device).cuda_stream


def cuda_out_in(op, output, out_name, input, in_name):
    """cuda_view() of an out-of-place call's output and input: (out address, out elements, in
    address, in elements, dtype, stream), or None when neither is a CUDA tensor. TypeError when
    only one is, or their dtypes or devices differ."""
    o, i = cuda_view(output, out_name), cuda_view(input, in_name)
    if o is None and i is None:
        return None
    if o is None or i is None or output.device != input.device:
        raise TypeError(f"{op}: {out_name} and {in_name} must both be CUDA tensors on one device, or both CPU")
    if o[2] != i[2]:
        raise TypeError(f"{op}: {out_name} and {in_name} must share a dtype")
    return o[0], o[1], i[0], i[1], o[2], o[3]


def views(ts, writable, what):
    """view() of each tensor of a list; all must share one dtype. Returns (addresses, counts, dtype)."""
    if isinstance(ts, (str, bytes)) or not hasattr(ts, "__iter__"):
        raise TypeError(f"{what} must be a list of tensors, got {type(ts).__name__}")
    vs = [view(t, writable, f"{what}[{i}]") for i, t in enumerate(ts)]
    dtypes = {v[2] for v in vs}
    if len(dtypes) > 1:
        raise TypeError(f"the tensors of {what} must share one dtype")
    return [v[0] for v in vs], [v[1] for v in vs], (dtypes.pop() if dtypes else None)


def rows(t):
    """Elements per index of dim 0 (for split sizes given in rows, as torch's all_to_all_single)."""
    shape = tuple(t.shape)
    if not shape:
        raise ValueError("all_to_all_single needs tensors with at least one dimension")
    n = 1
    for d in shape[1:]:
        n *= d
    return n
