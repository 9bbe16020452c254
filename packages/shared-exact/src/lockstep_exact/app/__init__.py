"""The application over the library: the ``lockstep`` CLI and what only it runs.

``cli`` (the ``lockstep`` console script), the qualification ladder (``qualify``, its report
``report``), the training loop (``train_loop``, ``rl``, ``rewards``, ``train_report``), the
first-divergence search (``bisect``), the sampler driven as a subprocess (``sampler_process``),
the tiny-model maker (``tiny``), the contract lock (``lock``), and the CLI's plumbing
(``quiet``, ``textfile``). They drive the engine plugins through the hooks (``plugins``,
``hookspecs``) and never import a plugin by name.

The library (every other module of ``lockstep_exact``) never imports this package; the
import-linter contracts in the root ``pyproject.toml`` hold both rules.
"""
