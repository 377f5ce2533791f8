"""Replay plans: their schema, fingerprint, refinement derivation, the release's builders and the
corrective plan, and the step budget a plan allows. Imports ``formats`` (manifests, to index a corpus).
"""
