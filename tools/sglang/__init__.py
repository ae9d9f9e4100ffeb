"""Released SGLang wheels as clients of the staging layer (``make sglang``, issue 17).

* :mod:`tools.sglang.venvs` builds one venv per supported release (``versions.py``) with only
  what the import chain of SGLang's disaggregation modules needs, and runs ``tests/sglang``
  in each.
* :mod:`tools.sglang.torchvision_stub` writes the stand-in ``torchvision`` package.
* :mod:`tools.sglang.adopt` applies the adopter change to the *installed* upstream modules
  at test time (no upstream source is kept in this repository).
* :mod:`tools.sglang.drive` drives upstream's functions with a scheduler and four workers.
"""
