"""Export the contracts as JSON Schema into ``schemas/jsonschema/``.

Run ``python -m schemas.export`` after changing a model; a test fails while the exported
files are stale. Arrow payload schemas are exported too (field name, type, nullability), so
producers in other languages can build conforming batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
from pydantic import BaseModel

from schemas.records import (
    REFINED_SCHEMA,
    ROLLUP_SCHEMA,
    Alert,
    DeadLetter,
    Episode,
    JobPlacement,
    RefinedHeader,
    TopologyEntity,
)
from schemas.wire import PAYLOAD_SCHEMAS, Envelope

OUT_DIR = Path(__file__).with_name("jsonschema")

MODELS: dict[str, type[BaseModel]] = {
    "envelope": Envelope,
    "refined_header": RefinedHeader,
    "deadletter": DeadLetter,
    "topology_entity": TopologyEntity,
    "job_placement": JobPlacement,
    "alert": Alert,
    "episode": Episode,
}


def _arrow_doc(schema: pa.Schema) -> list[dict[str, object]]:
    return [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema]


def rendered() -> dict[str, str]:
    """File name → exact file content, as :func:`main` writes it."""
    out = {
        f"{name}.schema.json": json.dumps(model.model_json_schema(), indent=2, sort_keys=True)
        + "\n"
        for name, model in MODELS.items()
    }
    arrow = {f"payload.{k.value}": _arrow_doc(s) for k, s in PAYLOAD_SCHEMAS.items()}
    arrow["refined"] = _arrow_doc(REFINED_SCHEMA)
    arrow["rollup"] = _arrow_doc(ROLLUP_SCHEMA)
    out["arrow-schemas.json"] = json.dumps(arrow, indent=2, sort_keys=True) + "\n"
    return out


def main() -> int:
    OUT_DIR.mkdir(exist_ok=True)
    for name, text in rendered().items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {len(rendered())} files to {OUT_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
