"""Plans: what runs where. `spec` holds the Plan type (stages, pipelines, replicas, memory options,
schedule), `placement` where its ranks sit, `orders` every pipeline schedule's op order (the one
definition the simulator times and the runtime runs), `sailor_config` the import of the public
Sailor `plan_config` format. `load_plan` / `plan_from_dict` here are the one plan loader, used by the
CLI and the API alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sailor.core.errors import SailorInputError
from sailor.core.fileio import mapping_from
from sailor.core.schema import parse_model
from sailor.plan.sailor_config import is_sailor_plan, sailor_plan_to_dict
from sailor.plan.spec import Plan
from sailor.specs import model_relative_to


def plan_from_dict(data: dict[str, Any], source: str | None = None) -> Plan:
    """A Plan from a mapping in our format, in what `sailor plan --json` prints (the chosen plan,
    with its job and cluster, under "plan"; its estimate and alternatives beside it are not read), or
    in the public Sailor `plan_config` format (detected; `sailor.plan.sailor_config`); `source` names
    the file in messages."""
    if is_plan_output(data):
        try:
            return plan_from_dict(data["plan"], source)
        except SailorInputError as e:
            raise e.located(source=source, field_prefix="plan") from None
    if is_sailor_plan(data):
        data = sailor_plan_to_dict(data, source)
    elif isinstance(data.get("job"), dict):  # a carried job's relative model path is the plan file's
        data = {**data, "job": model_relative_to(data["job"], source)}
    return parse_model(Plan, data, source)


def is_plan_output(data: Any) -> bool:
    """Whether `data` (a parsed file) is what `sailor plan --json` prints: a mapping holding the plan
    under "plan" and its "estimate", rather than a plan."""
    return isinstance(data, dict) and isinstance(data.get("plan"), dict) and "estimate" in data \
        and "micro_batch_size" not in data


def load_plan(source: str | Path | dict[str, Any] | Plan) -> Plan:
    """A validated plan from a YAML/JSON path (ours, `sailor plan --json`'s output or Sailor's
    plan_config), a dict of any of these, or a Plan (returned as is): the one plan loader, used by
    the CLI, the API and the runtime.

    Raises:
        SailorInputError: unreadable file, layers not covered, batch arithmetic wrong... (named with
            the file and field).
    """
    if isinstance(source, Plan):
        return source
    return plan_from_dict(*mapping_from(source, "Plan"))


def dumps(plan: Plan) -> str:
    """The plan as indented JSON (our format)."""
    return json.dumps(plan.to_dict(), indent=2)
