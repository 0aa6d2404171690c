"""``collsim schema KIND``: print the JSON Schema of scenario, topology or device files.

The schema comes from the same description the loaders check files against (written out by
:func:`collsim.core.schema_json.json_schema`), so an editor that validates with it agrees with
``collsim run``::

    collsim schema scenario > scenario.schema.json
    collsim schema topology > topology.schema.json
    collsim schema device > device.schema.json
"""

from __future__ import annotations

import json

import click

from collsim.cli.common import OneLineCommand

__all__ = ["schema"]


@click.command(name="schema", cls=OneLineCommand)
@click.argument("kind", type=click.Choice(["scenario", "topology", "device"]))
def schema(kind: str) -> None:
    """Print the JSON Schema (draft 2020-12) of KIND files on stdout."""
    # the described modules import the model, plan and topology layers: only for this command
    from collsim.cluster.hardware import DEVICE
    from collsim.cluster.topology import TOPOLOGY
    from collsim.core.schema_json import json_schema
    from collsim.study.scenario import SCENARIO

    spec = {"scenario": SCENARIO, "topology": TOPOLOGY, "device": DEVICE}[kind]
    click.echo(json.dumps(json_schema(kind, spec), indent=2))
