from __future__ import annotations

import collsim


def test_public_names_are_pinned() -> None:
    assert sorted(collsim.__all__) == sorted(
        [
            "__version__",
            "CollsimError",
            "CollsimWarning",
            "ConfigError",
            "InfeasibleError",
            "SimulationError",
        ]
    )
