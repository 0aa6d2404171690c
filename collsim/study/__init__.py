"""Studies of a scenario: sweeps over its knobs and goodput over a long job."""
