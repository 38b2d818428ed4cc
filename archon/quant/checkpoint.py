"""A quantized HF checkpoint seen by its logical weights: `q_proj.weight` is one key whether it is
stored plain or as data and scale tensors. `get` dequantizes (what loading with
model.quantized_base='dequantize' uses); `storage` reads the in-memory storage of a quantized
weight (archon.quant.formats) for a base kept quantized."""

from __future__ import annotations

import math

import torch

from archon.checkpoint.hf import HFCheckpoint, _combine_is_stack_of_cat, copy_local_into, local_region
from archon.quant.formats import FP4_VALUES, FP8_MAX, QuantFormat, dequantize, fp8_rows_from_checkpoint

_FP8_DTYPE = "F8_E4M3"

MAX_DEQUANTIZED_WEIGHT = 65504.0
"""The largest weight magnitude a checkpoint's scales may let its format reach: float16's largest
finite value. The weights of trained LLMs are orders of magnitude below it (their fp16 releases hold
them), so a scale that takes the format's largest value past it is a damaged scale (a flipped
exponent bit, bytes of another dtype), not a model; 1e30 is refused, 0.1 is far inside."""
MXFP4_MAX_EXPONENT = 127 + math.floor(math.log2(MAX_DEQUANTIZED_WEIGHT / FP4_VALUES[7]))
"""The largest e8m0 scale byte of an mxfp4 block under MAX_DEQUANTIZED_WEIGHT (6 x 2^13 = 49152)."""
E8M0_NAN = 255


def scale_problem(fmt: QuantFormat, scale: torch.Tensor) -> str | None:
    """What is wrong with the whole scale tensor `scale` of one weight as a checkpoint stores it
    (fp8: float scales; mxfp4: uint8 e8m0 exponents), or None: a NaN or infinite scale, a negative
    one, every scale zero (a weight of zeros), or one past MAX_DEQUANTIZED_WEIGHT."""
    if fmt.method == "mxfp4":
        if scale.dtype != torch.uint8:
            return None  # refused with the storage's dtype check
        exponents = scale.to(torch.int32)
        if bool((exponents == E8M0_NAN).any()):
            return f"holds {E8M0_NAN} (NaN in e8m0) at index {_first(exponents == E8M0_NAN)}"
        if bool((exponents == 0).all()):
            return "is all zero bytes (2^-127: every weight zero)"
        if int(exponents.max()) > MXFP4_MAX_EXPONENT:
            at = _first(exponents > MXFP4_MAX_EXPONENT)
            return (
                f"holds exponent {int(exponents.max())} (at index {at}), past {MXFP4_MAX_EXPONENT}: weights up to "
                f"6 x 2^{int(exponents.max()) - 127}, beyond {MAX_DEQUANTIZED_WEIGHT:g}"
            )
        return None
    values = scale.to(torch.float64)
    if not bool(torch.isfinite(values).all()):
        at = _first(~torch.isfinite(values))
        return f"holds {values[tuple(at)].item()} at index {at}; scales must be finite"
    if bool((values < 0).any()):
        at = _first(values < 0)
        return f"holds {values[tuple(at)].item():g} at index {at}; scales must not be negative"
    if bool((values == 0).all()):
        return "is all zero (every weight zero)"
    largest = MAX_DEQUANTIZED_WEIGHT / FP8_MAX
    if values.max().item() > largest:
        at = _first(values > largest)
        return (
            f"holds {values.max().item():g} at index {at}, past {largest:.4g}: weights up to "
            f"{FP8_MAX:g} x that, beyond {MAX_DEQUANTIZED_WEIGHT:g}"
        )
    return None


def _first(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask)[0].tolist() if mask.dim() else []


class QuantizedCheckpoint:
    """`checkpoint` (an HFCheckpoint whose config names `fmt`) by logical HF weight name."""

    def __init__(self, checkpoint: HFCheckpoint, fmt: QuantFormat) -> None:
        self.checkpoint = checkpoint
        self.fmt = fmt
        self.path = checkpoint.path
        stored = checkpoint.keys()
        self.quantized: dict[str, tuple[str, str]] = {}  # logical name -> (data key, scale key)
        for key in sorted(stored):
            if fmt.method == "fp8":
                if self._stored_dtype(key) == _FP8_DTYPE:
                    self.quantized[key] = fmt.stored_keys(key)
                elif key.endswith("weight" + fmt.scale_suffix):
                    weight = key.removesuffix(fmt.scale_suffix)
                    if weight not in stored:
                        raise KeyError(self._orphan(key, weight))
                    if self._stored_dtype(weight) != _FP8_DTYPE:
                        raise ValueError(
                            f"checkpoint {str(self.path)!r}: {weight!r} in {self.checkpoint.file_of(weight).name!r} "
                            f"has a scale ({key!r}) but is stored as {self._stored_dtype(weight)}, not {_FP8_DTYPE}; "
                            f"the config's quantization_config names {fmt}"
                        )
            elif key.endswith(("_blocks", "_scales")):
                self.quantized[fmt.logical_name(key)] = fmt.stored_keys(fmt.logical_name(key))
        for name, (data_key, scale_key) in self.quantized.items():
            for needed, other in ((data_key, scale_key), (scale_key, data_key)):
                if needed not in stored:
                    raise KeyError(
                        f"checkpoint {str(self.path)!r}: {other!r} (in {self.checkpoint.file_of(other).name!r}) has "
                        f"no {needed!r}; a weight stored as {fmt} needs both"
                    )
        # Static activation scales (`X.input_scale` beside an fp8 `X.weight`) serve fp8 GEMM kernels;
        # archon's GEMMs run in the training dtype on dequantized weights, so they are not needed.
        activation_scales = {
            key
            for key in stored
            for suffix in ("input_scale", "activation_scale")
            if key.endswith("." + suffix) and key.removesuffix(suffix) + "weight" in self.quantized
        }
        self._plain = stored - {k for pair in self.quantized.values() for k in pair} - activation_scales
        self._check_scales()

    def _check_scales(self) -> None:
        """Every weight's scales finite, not negative, not all zero and not absurdly large
        (archon.quant.formats.scale_problem), read in full when the checkpoint is opened: a damaged
        scale would otherwise build a model that trains on garbage or fails steps later."""
        for _, scale_key in self.quantized.values():
            problem = scale_problem(self.fmt, self.checkpoint.get(scale_key))
            if problem is not None:
                raise ValueError(
                    f"checkpoint {str(self.path)!r}: scale {scale_key!r} in "
                    f"{self.checkpoint.file_of(scale_key).name!r} {problem}; the checkpoint is damaged"
                )

    def _stored_dtype(self, key: str) -> str:
        return self.checkpoint._handle(key).get_slice(key).get_dtype()

    def _orphan(self, scale_key: str, weight_key: str) -> str:
        return (
            f"checkpoint {str(self.path)!r}: scale {scale_key!r} in {self.checkpoint.file_of(scale_key).name!r} "
            f"has no weight {weight_key!r}"
        )

    # ---- the HFCheckpoint interface, by logical name ------------------------------------------
    def keys(self) -> set[str]:
        return self._plain | set(self.quantized)

    def file_of(self, key: str):
        return self.checkpoint.file_of(self.quantized[key][0] if key in self.quantized else key)

    def shape(self, key: str) -> list[int]:
        if key not in self.quantized:
            return self.checkpoint.shape(key)
        rows = self._rows_shape(key)
        return [*rows[:-2], rows[-1], rows[-2]] if self.fmt.hf_transposed() else rows

    def dtype(self, key: str) -> torch.dtype:
        return torch.float32 if key in self.quantized else self.checkpoint.dtype(key)

    def get(self, key: str) -> torch.Tensor:
        """The tensor, dequantized to fp32 when stored quantized (as the HF model holds it)."""
        if key not in self.quantized:
            return self.checkpoint.get(key)
        weight = dequantize(self.fmt, *self.storage(key), torch.float32)
        return weight.transpose(-1, -2) if self.fmt.hf_transposed() else weight

    def get_slice(self, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        if key not in self.quantized:
            return self.checkpoint.get_slice(key, region)
        return self.get(key)[region]

    def config(self) -> dict:
        return self.checkpoint.config()

    # ---- quantized storage --------------------------------------------------------------------
    def _rows_shape(self, key: str) -> list[int]:
        """[..., out, in] of quantized weight `key`."""
        data_key, _ = self.quantized[key]
        shape = self.checkpoint.shape(data_key)
        if self.fmt.method == "fp8":
            return shape
        return [*shape[:-2], shape[-2] * shape[-1] * 2]

    def storage_shape(self, key: str) -> tuple[int, ...]:
        """Shape of the in-memory storage data of quantized weight `key` ([..., out, in'])."""
        return self.fmt.storage_shapes(tuple(self._rows_shape(key)))[0]

    def storage(
        self, key: str, data_region: tuple[slice, ...] | None = None, scale_region: tuple[slice, ...] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(data, scale) of quantized weight `key` in archon's in-memory storage (rows [..., out]),
        after checking the stored shapes; errors name the tensor and its file. `data_region` and
        `scale_region` (one slice per storage dim, a rank's shard as `local_region` gives it, the
        same rows in both): only that box is read."""
        data_key, scale_key = self.quantized[key]
        data_shape, scale_shape = self.checkpoint.shape(data_key), self.checkpoint.shape(scale_key)
        if self.fmt.method == "fp8":
            want = self.fmt.checkpoint_scale_shape(data_shape)
            layout = (
                f"weight_block_size {list(self.fmt.block_size)}"
                if self.fmt.config.get("quant_method", "fp8") == "fp8"
                else f"{self.fmt} (quantization_config.config_groups)"
            )
            why = f"{layout} over {data_key!r} of shape {tuple(data_shape)}"
            if want == [1] and list(scale_shape) in ([], [1, 1]):
                want = list(scale_shape)  # one scale for the tensor, stored with any layout of one value
        else:
            want = data_shape[:-1]
            why = f"one e8m0 exponent per 32 values of {data_key!r} of shape {tuple(data_shape)}"
            if data_shape[-1] != 16:
                raise ValueError(
                    f"mxfp4 blocks {data_key!r} in {self.checkpoint.file_of(data_key).name!r} have shape "
                    f"{tuple(data_shape)}; the last dimension must be 16 (32 packed e2m1 values)"
                )
        if list(scale_shape) != list(want):
            raise ValueError(
                f"scale {scale_key!r} in {self.checkpoint.file_of(scale_key).name!r} has shape {tuple(scale_shape)}, "
                f"but {why} needs {tuple(want)}"
            )
        if data_region is None:
            data_storage, scale_storage = self.fmt.storage_shapes(tuple(self._rows_shape(key)))
            data_region = tuple(slice(0, n) for n in data_storage)
            scale_region = tuple(slice(0, n) for n in scale_storage)
        *lead, rows, columns = data_region
        if self.fmt.method == "fp8":
            data = self.checkpoint.get_slice(data_key, data_region)
            br = self.fmt.block_size[0]
            if self.fmt.block_size == (None, None):  # one scale for the tensor
                return fp8_rows_from_checkpoint(data, self.checkpoint.get(scale_key), None)
            # Scale rows of the blocks these rows lie in, repeated per row (archon.quant.formats).
            block_rows = slice(rows.start // br, math.ceil(rows.stop / br))
            scale = self.checkpoint.get_slice(scale_key, (*lead, block_rows, scale_region[-1]))
            return fp8_rows_from_checkpoint(data, scale, br, first_row=rows.start - block_rows.start * br)
        # mxfp4: storage columns are bytes of the flattened [G, 16] blocks.
        groups = slice(columns.start // 16, math.ceil(columns.stop / 16))
        blocks = self.checkpoint.get_slice(data_key, (*lead, rows, groups, slice(0, 16)))
        scale = self.checkpoint.get_slice(scale_key, (*lead, rows, scale_region[-1]))
        if blocks.dtype != torch.uint8 or scale.dtype != torch.uint8:
            raise ValueError(
                f"mxfp4 tensors {data_key!r} / {scale_key!r} in {self.checkpoint.file_of(data_key).name!r} are "
                f"{blocks.dtype} / {scale.dtype}; both must be uint8"
            )
        skip = columns.start - groups.start * 16
        data = blocks.flatten(-2)[..., skip : skip + columns.stop - columns.start]
        return data.contiguous(), scale.contiguous()


def _source_rows(converter, key: str, shapes: list[torch.Size]) -> torch.Tensor:
    """Where each row of archon weight `key` comes from, for sources of row-major `shapes`
    [..., rows, cols]: an index into the sources' rows taken in order (leading dims flattened), of
    the combined shape without its column dim. The converter's `combine` runs on probes of two
    columns (row id, -row id - 1): a converter that only moves rows keeps each pair intact."""
    probes, offset = [], 0
    for shape in shapes:
        n = shape[:-1].numel()
        ids = torch.arange(offset, offset + n, dtype=torch.float64).reshape(shape[:-1])
        probes.append(torch.stack((ids, -ids - 1), dim=-1))
        offset += n
    try:
        out = converter.combine(key, probes)
    except Exception as e:
        raise ValueError(
            f"{key!r}: its converter cannot combine the checkpoint's quantized rows ({e}); load the base with "
            "model.quantized_base='dequantize'"
        ) from None
    ids = out[..., 0]
    if (
        not torch.equal(out[..., 1], -ids - 1)
        or not torch.equal(ids, ids.round())
        or (ids < 0).any()
        or (ids >= offset).any()
    ):
        raise ValueError(
            f"{key!r}: its converter changes values or columns, not only the order of rows, so the quantized "
            "blocks cannot be kept; load the base with model.quantized_base='dequantize'"
        )
    return ids.long()


def _combined_storage(checkpoint: QuantizedCheckpoint, sources: list[str], rows: torch.Tensor):
    """(data, scale) storage of an archon weight from its quantized checkpoint `sources`, row `i`
    of the result being row `rows[i]` of the sources' rows taken in order (`_source_rows`)."""
    pairs = [checkpoint.storage(s) for s in sources]
    out = []
    for part in range(2):
        flat = torch.cat([pair[part].reshape(-1, pair[part].shape[-1]) for pair in pairs])
        out.append(flat[rows.reshape(-1)].reshape(*rows.shape, flat.shape[-1]))
    return out


def _stacked_storage(
    checkpoint: QuantizedCheckpoint, sources: list[str], num_stacked: int, experts: slice, rows: slice
):
    """(data, scale) of the stacked experts `experts` (rows `rows`) from per-expert sources, each
    expert's sources concatenated on rows; only those experts' tensors are read."""
    per_expert = len(sources) // num_stacked
    datas, scales = [], []
    for expert in range(experts.start, experts.stop):
        pairs = [checkpoint.storage(s) for s in sources[expert * per_expert : (expert + 1) * per_expert]]
        datas.append(torch.cat([p[0] for p in pairs])[rows])
        scales.append(torch.cat([p[1] for p in pairs])[rows])
    return torch.stack(datas), torch.stack(scales)


def load_quantized_weight(
    module, name: str, converter, checkpoint: QuantizedCheckpoint, key: str, sources: list[str]
) -> None:
    """Fill the storage of quantized weight `name` of `module` (archon key `key`) from its
    checkpoint `sources`, reading only this rank's experts when they are stacked from per-expert
    tensors."""

    info = module._quantized[name]
    plain = [s for s in sources if s not in checkpoint.quantized]
    if plain:
        raise ValueError(
            f"{key!r} is built from quantized and plain checkpoint tensors ({plain[0]!r} in "
            f"{checkpoint.file_of(plain[0]).name!r} is plain); archon keeps a weight quantized only when all are"
        )
    data_param, scale_param = module.storage(name)
    data_region, scale_region = local_region(data_param), local_region(scale_param)
    if data_region is not None and (info.fmt.column_block or 1) > 1:
        first_data, first_scale = data_region[-1].start, scale_region[-1].start
        per_byte = 2 if info.fmt.method == "mxfp4" else 1
        if first_data * per_byte != first_scale * info.fmt.column_block:
            raise ValueError(
                f"{key!r}: this rank's part starts at input column {first_data * per_byte}, inside a block of "
                f"{info.fmt.column_block} columns that shares one scale; under tensor parallelism the input "
                f"features ({info.rows_shape[-1]}) must be a multiple of tp x {info.fmt.column_block}"
            )
    stacked = (
        data_region is not None
        and len(sources) > 1
        and len(info.rows_shape) == 3
        and _combine_is_stack_of_cat(converter, key, len(sources), info.rows_shape[0])
    )
    if stacked:
        data, scale = _stacked_storage(checkpoint, sources, info.rows_shape[0], data_region[0], data_region[1])
        data, scale = data[..., data_region[-1]], scale[..., scale_region[-1]]
    else:
        shapes = [torch.Size(checkpoint.storage_shape(s)) for s in sources]
        rows = _source_rows(converter, key, shapes)
        got, want = (*rows.shape, shapes[0][-1]), info.fmt.storage_shapes(info.rows_shape)[0]
        if tuple(got) != tuple(want):
            raise ValueError(
                f"checkpoint tensor {sources[0]!r} in {checkpoint.file_of(sources[0]).name!r} gives {key!r} "
                f"{info.fmt} storage of shape {tuple(got)}, but the model expects {tuple(want)}"
            )
        one_to_one = len(sources) == 1 and torch.equal(rows.reshape(-1), torch.arange(rows.numel()))
        if data_region is not None and one_to_one:  # read this rank's shard only
            data, scale = checkpoint.storage(sources[0], data_region, scale_region)
        else:
            data, scale = _combined_storage(checkpoint, sources, rows)
            if data_region is not None:
                data, scale = data[data_region], scale[scale_region]
    copy_local_into(data_param, data, f"{key}_qdata")
    copy_local_into(scale_param, scale, f"{key}_qscale")
