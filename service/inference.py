"""ONNX inference for a bundle's models (and the feature-less prior model)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort
from threadpoolctl import threadpool_limits

from service.bundle import Manifest, ModelSpec, bundle_relative
from service.errors import BundleError
from service.linear_onnx import LinearModel, agrees, read_linear
from service.types import FloatVector


def limit_blas_threads() -> None:
    """numpy's BLAS on one thread in this process, as the ONNX sessions are (``open_onnx``):
    requests run in parallel, not their matrix products (``fft_bands``'s DFT is two). On
    more threads OpenBLAS splits even a 128 px image's product and its helper threads then
    spin on the cores other requests need (CPU ~5x the wall time, measured); the service
    calls this at start-up and the builders before they profile, so the costs the bundle
    records are the ones served. (threadpoolctl leaves OpenBLAS's limit to the first live
    thread that set one: call it from the main thread, as uvicorn's start-up does.)"""
    threadpool_limits(limits=1, user_api="blas")


def bundle_file(bundle_dir: Path, file: str, what: str) -> Path:
    """``bundle_dir / file`` once it is known to be a regular file inside the bundle folder
    (symlinks followed): ``BundleError`` naming ``what`` otherwise. Nothing is opened."""
    try:
        bundle_relative(file)
    except ValueError as exc:
        raise BundleError(f"{what}: {exc}") from None
    root = bundle_dir.resolve()
    path = (bundle_dir / file).resolve()
    if not path.is_relative_to(root):
        raise BundleError(
            f"{what}: {file!r} resolves outside the bundle folder (a symlink leaving it?)"
        )
    if not path.exists():
        raise BundleError(f"{what}: ONNX file {file!r} is missing")
    if not path.is_file():
        raise BundleError(f"{what}: {file!r} is not a regular file")
    return path


def open_onnx(bundle_dir: Path, file: str, what: str, field: str = "file") -> ort.InferenceSession:
    """An ONNX Runtime session on ``bundle_dir / file`` (one thread: requests run in
    parallel, not their models); ``BundleError`` naming ``what`` and the manifest's
    ``field`` if the file is outside the bundle folder, missing or does not load.

    The file's bytes are read here and handed to ONNX Runtime, so nothing but that file
    is opened (an ONNX model pointing at external data elsewhere does not load)."""
    return open_onnx_bytes(
        bundle_file(bundle_dir, file, f"{what}: {field}").read_bytes(), what, file, field
    )


def open_onnx_bytes(data: bytes, what: str, file: str, field: str = "file") -> ort.InferenceSession:
    """:func:`open_onnx` on the bytes of ``file``, read already."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise BundleError(f"{what}: cannot load {field} {file!r}: {exc}") from exc


class LoadedModel:
    """One model of a bundle: ``predict_proba(features) -> class probabilities``. A linear
    model that numpy scores as ONNX Runtime does is scored by numpy (``linear``:
    ``service.linear_onnx``), any other by ONNX Runtime."""

    def __init__(self, spec: ModelSpec, bundle_dir: Path, n_classes: int) -> None:
        self.spec = spec
        self.features = tuple(spec.features)
        self._prior: FloatVector | None = None
        self._session: ort.InferenceSession | None = None
        self.linear: LinearModel | None = None
        if spec.prior is not None:
            self._prior = np.asarray(spec.prior, dtype=np.float32)
            return
        assert spec.file is not None
        what = f"model {spec.id!r}"
        data = bundle_file(bundle_dir, spec.file, f"{what}: file").read_bytes()
        self._session = open_onnx_bytes(data, what, spec.file)
        inputs = self._session.get_inputs()
        if len(inputs) != 1:
            raise BundleError(f"model {spec.id!r}: expected one input, found {len(inputs)}")
        self._input = inputs[0].name
        outputs = [o.name for o in self._session.get_outputs()]
        self._output = "probabilities" if "probabilities" in outputs else outputs[-1]
        probe = self._session.run(
            [self._output], {self._input: np.zeros((1, spec.input_dims), dtype=np.float32)}
        )[0]
        if np.asarray(probe).shape != (1, n_classes):
            raise BundleError(
                f"model {spec.id!r}: output shape {np.asarray(probe).shape}, "
                f"expected (1, {n_classes})"
            )
        linear = read_linear(data, self._input, self._output)
        if (
            linear is not None
            and linear.input_dims == spec.input_dims
            and agrees(linear, self._session, self._input, self._output)
        ):
            self.linear = linear

    def predict_proba(self, features: Mapping[str, FloatVector]) -> FloatVector:
        if self._prior is not None:
            return self._prior
        x = np.concatenate([features[f] for f in self.features]).astype(np.float32, copy=False)
        if self.linear is not None:
            return self.linear.predict_proba(x)
        assert self._session is not None
        out = self._session.run([self._output], {self._input: x.reshape(1, -1)})[0]
        result: FloatVector = np.asarray(out, dtype=np.float32)[0]
        return result


def load_models(manifest: Manifest, bundle_dir: Path) -> dict[str, LoadedModel]:
    n_classes = len(manifest.classes)
    return {m.id: LoadedModel(m, bundle_dir, n_classes) for m in manifest.models}
