"""TLT inside verl 0.9.1, no fork: trainer mode ``tlt``, rollout backend ``tlt``, CPU shims.

Loaded by verl's ``verl.plugins`` entry point (``tlt.integrations.verl.plugin``) in every process
that imports verl. Nothing here imports verl at package import time.
"""
