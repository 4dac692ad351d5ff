"""What the benchmark scripts beside this package share, so that each script holds only what it
measures: the daemon a run starts (daemon), the V4.1-shaped host tables it fills (tables), the row
IDs it draws (ids), bit-exact row comparison (rows), stream timing (timing), run metadata
(report) and the engine recipes' plugin checks (plugin_check).

Not a library for engramd itself: nothing under server/, client/ or kernels/ imports it. Scripts
import it as `common` after putting their own folder first on sys.path.
"""
