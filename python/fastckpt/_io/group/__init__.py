"""Process-group plumbing: one session per collective call (distributed), who takes part (participation), the
store waits that turn a missing rank into a clear error (store_wait), torch version shims (torch_compat).

May import: layers 0-1 and the shared ``_io`` modules (files, log, location); never another ``_io`` sub-package.
"""
