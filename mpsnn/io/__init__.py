"""Saving and loading mpsnn objects (the role of MPS's ``NSSecureCoding``): `save`, `load`, and
the codec table that says how each class is written and rebuilt.

File format (version 1)
-----------------------

One safetensors file. Its tensors hold every tensor of the saved objects (CPU, contiguous,
in their own dtype); its header's ``__metadata__`` map holds one key, ``"mpsnn"``, whose
value is a JSON document::

    {"format": "mpsnn", "version": 1, "root": <value>, "objects": [<object>, ...]}

* ``<object>`` is ``{"type": <registered name>, "fields": {...}}``; what the fields are is the
  business of the type's codec (`register_codec`). An object referenced several times is
  written once and comes back as one object (a kernel and the checkpoint both referencing a
  data source, two data sources sharing an optimizer, two graphs sharing nodes). An object's
  fields reference only objects earlier in the table; every object is referenced.
* ``<value>`` is JSON ``null``, a boolean, an int, a finite float, a string or a list
  (a Python list), or a tagged JSON object with one tag: ``{"$obj": i}`` (object ``i`` of the
  table), ``{"$tensor": name, "dtype": "float32", "shape": [...]}`` (a tensor of the file),
  ``{"$dict": {...}}`` (a dict with str keys), ``{"$tuple": [...]}``, ``{"$float": "nan" |
  "inf" | "-inf"}``.

Guarantees
----------

* Loading never executes code: no pickle, no eval, no import by name. A type is resolved
  through the codec table only; an unknown type is rejected.
* A file is checked before anything is built: a regular file (not a device or a pipe), the
  safetensors header (length, JSON, entries tiling the data, the data's extent: a truncated
  file is rejected), the ``"mpsnn"`` document (format,
  version, keys), every tensor reference (present, with the dtype and shape the structure
  states), no tensor the structure does not reference. Codecs then check what their class
  needs (shapes against descriptors, dtypes against the parameters). Every rejection is a
  `CheckpointError` (a `ValueError`) reading ``[load] what must hold, got what``.
* Writes are atomic: the file is written to a temporary file in the target's directory
  (``.<name>.<pid>.<random>.tmp``), fsynced, and renamed onto the target (then the directory
  is fsynced where the platform allows). A save that raises removes its temporary file; a
  process killed mid-save leaves the previous file intact and a stray temporary file, never
  read by `load`, which the next save to that name removes (`remove_stale_temporary_files`).
* Memory: `load` checks the header first and reads each tensor straight into its own memory;
  `save` writes each tensor from its own memory (strided and GPU tensors through a 16 MiB
  staging buffer). Neither builds the file in memory.
* `load` restores values bit for bit, on the device asked for: weights, optimizer state
  vectors, the optimizers' hyperparameter tensors and Adam's step, dropout counters.

`save` reads tensors on the current stream: wait for committed command buffers first.

Modules: `mpsnn.io.container` (`save`, `load`, the document), `mpsnn.io.files` (the bytes:
header, tensors, atomic writes), `mpsnn.io.codec` (the table, the
`Encoder` and `Fields`), and the codecs: `mpsnn.io.data_sources` (descriptors, optimizers,
data sources), `mpsnn.io.declared` (every kernel class that declares its saved fields, see
`mpsnn.core.saved`), `mpsnn.io.declared_nodes` (every forward node class that declares them),
`mpsnn.io.kernels` and `mpsnn.io.kernels_more` (the other kernels),
`mpsnn.io.graph_nodes` and `mpsnn.io.graph_nodes_more` (the forward node recipe),
`mpsnn.io.graph_training` (how a training graph's gradient nodes were made) and
`mpsnn.io.graphs` (`Graph`).
"""

from __future__ import annotations

from mpsnn.errors import CheckpointError
from mpsnn.io import data_sources as data_sources  # each codec module registers its codecs
from mpsnn.io import declared as declared
from mpsnn.io import declared_nodes as declared_nodes
from mpsnn.io import graph_nodes as graph_nodes
from mpsnn.io import graph_nodes_more as graph_nodes_more
from mpsnn.io import graph_training as graph_training
from mpsnn.io import graphs as graphs
from mpsnn.io import kernels as kernels
from mpsnn.io import kernels_more as kernels_more
from mpsnn.io.codec import Codec, Encoder, Fields, register_codec, registered_types
from mpsnn.io.container import FORMAT, METADATA_KEY, VERSION, load, save
from mpsnn.io.files import remove_stale_temporary_files

__all__ = [
    "FORMAT",
    "METADATA_KEY",
    "VERSION",
    "CheckpointError",
    "Codec",
    "Encoder",
    "Fields",
    "load",
    "register_codec",
    "registered_types",
    "remove_stale_temporary_files",
    "save",
]
