"""A Seldon MLServer custom runtime doing the bare app's work (``benchmarks.service``):
decode the PNG of a ``BYTES`` input named ``png`` as budgetserve does, extract the
``thumbnail`` feature with the same plugin, run the bundle's ``thumbnail`` ONNX model, answer
the class as a ``BYTES`` output named ``prediction``.

MLServer is not a dependency of budgetserve: ``benchmarks.service`` installs it in a venv of
its own (``.bench/mlserver``) and runs ``mlserver start`` with this module importable (the
repository on ``PYTHONPATH``). The model's ``parameters.uri`` is the bundle folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from mlserver import MLModel
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput

FEATURE = "thumbnail"


class ThumbnailRuntime(MLModel):  # type: ignore[misc]  # MLServer is untyped here
    async def load(self) -> bool:
        from service.bundle import read_manifest
        from service.extractors.base import create_extractor
        from service.inference import LoadedModel
        from service.items import make_decoder

        folder = Path(str(self.settings.parameters.uri))
        manifest = read_manifest(folder)
        spec = next(m for m in manifest.models if m.id == FEATURE)
        entry = next(e for e in manifest.extractors if e.name == FEATURE)
        self.extractor = create_extractor(entry.entry_point, entry.version, entry.params)
        self.model = LoadedModel(spec, folder, len(manifest.classes))
        self.decoder = make_decoder(manifest.item, 1 << 20)
        self.classes = manifest.classes
        blank = np.zeros((32, 32), dtype=np.float32)
        self.model.predict_proba({FEATURE: np.asarray(self.extractor.extract(blank), np.float32)})
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        raw: Any = payload.inputs[0].data[0]
        png = raw.decode() if isinstance(raw, bytes) else str(raw)
        item = self.decoder.decode({"png_base64": png})
        vector = np.asarray(self.extractor.extract(item.data), dtype=np.float32)
        proba = self.model.predict_proba({FEATURE: vector})
        label = self.classes[int(np.argmax(proba))]
        return InferenceResponse(
            model_name=self.name,
            outputs=[ResponseOutput(name="prediction", shape=[1], datatype="BYTES", data=[label])],
        )
