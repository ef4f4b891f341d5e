"""Plans: what runs where. `spec` holds the Plan type (stages, pipelines, replicas, memory options,
schedule), `placement` where its ranks sit, `orders` every pipeline schedule's op order (the one
definition the simulator times and the runtime runs), `sailor_config` the import of the public
Sailor `plan_config` format. `load_plan` / `plan_from_dict` here are the one plan loader, used by the
CLI and the API alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sailor.core.fileio import load_mapping
from sailor.core.schema import parse_model
from sailor.plan.sailor_config import is_sailor_plan, sailor_plan_to_dict
from sailor.plan.spec import Plan


# ---- loading ---------------------------------------------------------------------------------
def plan_from_dict(data: dict[str, Any], source: str | None = None) -> Plan:
    """A Plan from our format or the public Sailor `plan_config` format (detected; `sailor.plan.sailor_config`)."""
    if is_sailor_plan(data):
        data = sailor_plan_to_dict(data, source)
    return parse_model(Plan, data, source)



def load_plan(path: str | Path) -> Plan:
    """Read a plan file (ours or Sailor's plan_config); raises SailorInputError naming file and field."""
    return plan_from_dict(load_mapping(path), str(path))



def dumps(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2)
