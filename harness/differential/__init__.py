"""The differential gate: the same cases on pristine SGLang 0.5.20 and on the patched
tree, one process each, compared byte for byte (docs/differential.md).

inventory  what must be covered, parsed from the pristine source
scenarios  device pools (SGLang's own classes) and the SGLang entry point that builds
           their host pools
runner     runs every case in one process, writes the outcomes as JSON
entry      SGLang's entry points (flags -> published config -> host pools)
steps      trips through the cache controller, the L3 storage path
probe      what a state records: tensor layouts, storage hashes, pointer tables, sizes
compare    case-by-case comparison of two outcome files, and its report
pair       both trees side by side, then the comparison (CPU tier and GPU alike)
kernels    emulated kernels on CPU, or the real ones on a GPU
"""
