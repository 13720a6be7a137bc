"""Layer 4, plans: validate everything, then apply.

save (live objects -> a ``SavePlan`` in fastckpt's layout), accelerate_format (the same in accelerate's exact
layout), load (phase 1: read and validate every part of a folder), apply (phase 2: ``LoadPlan.apply``),
accelerate_load (phase 1 for folders stock accelerate wrote), convert (between the two layouts).

May import: layers 0-3 and other ``_plan`` modules; never a public module.
"""
