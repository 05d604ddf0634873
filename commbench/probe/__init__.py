"""The probe as a command: `commbench probe`.

command (the CLI) -> snapshot (every step in a child process, merged into one JSON dict; software:
what is installed) -> verdicts (can each backend variant run here, and why not) -> render
(+ render_pcie, tables) or plot. The steps and the torch-free facts they read and check live below,
in commbench.topology; the variants come from commbench.backends.
"""
