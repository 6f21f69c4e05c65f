"""The storage floor, under the contract: where a path or URL points (`places`: a local Path or a StorePath on an
object store, the one `location()`), whole-file writes that never follow a link (`files`), reads and writes of whole
files and objects with their sha256 (`reads`, `writes`), a store's faults (`faults`), a writer's lease on a store
prefix (`lease`), one writer per output folder (`locks`) and a full device told apart (`disk`). It imports nothing
else of ours; fsspec is imported here only."""
