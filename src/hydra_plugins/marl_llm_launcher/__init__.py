"""marl-llm's Hydra launchers (sweep_launcher.py): Hydra instantiates launchers only from the
`hydra_plugins` namespace package."""
