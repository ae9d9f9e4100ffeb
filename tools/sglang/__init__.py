"""Released SGLang wheels as clients of the staging layer (``make sglang``, issue 17).

* :mod:`tools.sglang.venvs` builds one venv per supported release (``versions.py``) with only
  what the import chain of SGLang's disaggregation modules needs, and runs ``tests/sglang``
  in each.
* :mod:`tools.sglang.torchvision_stub` writes the stand-in ``torchvision`` package.
* :mod:`tools.sglang.venvs` also installs our built wheel into each venv: SGLang's own
  ``load_plugins()`` then applies the plugin (:mod:`staging.sglang`); no source is patched.
* :mod:`tools.sglang.adopt` lifts the released transfer worker's clean-up block out of the
  installed module, to run it in the test's workers (no upstream source is kept here).
* :mod:`tools.sglang.drive` drives upstream's functions with a scheduler and four workers,
  plugin off (the released objects put back) and on.
"""
