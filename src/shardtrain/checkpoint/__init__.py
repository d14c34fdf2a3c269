"""Checkpoints: save, load on any world size and ZeRO stage, consolidate to one file, export
to the Hugging Face layout.

A checkpoint is a directory ``<save_dir>/<tag>/``:

* ``meta.json``: format version, world size, stage, precision, the resolved config, the
  model's own configuration (a Hugging Face ``config.to_dict()``, when it has one),
  counters, scheduler and loss-scaler state, the optimizer's param-group hyperparameters
  and per-parameter scalar states, and for every parameter its shape, dtype and which
  ``[lo, hi)`` of its flattened elements each rank file holds; sizes and CRC32s of the files.
* ``rank{r:05d}.safetensors``: rank ``r``'s even shard ``shard_range(numel, world, r)`` of
  every trainable parameter (``param/<name>``), of its fp32 master in 16-bit modes
  (``master/<name>``) and of each per-element optimizer state (``optim/<name>/<key>``);
  rank 0 also holds frozen parameters and buffers whole. Plus RNG and client tensors. Its
  header records a CRC32 checksum of each tensor, so that a reader of a few tensors checks
  them without reading the others.
* ``rank{r:05d}.json``: the rank's RNG states and the JSON part of its ``client_state``.
* ``rank{r:05d}.client.pt``, only when ``client_state`` holds values JSON cannot (a trainer's
  whole state: nested tensors, sets, ``OrderedDict``s, ...): those keys, written by
  ``torch.save``.

Tensors come from safetensors and everything else from JSON, except that client file, which
is read with torch's restricted unpickler (``torch.load(weights_only=True)``): containers,
numbers, strings, tensors and the types registered with
``torch.serialization.add_safe_globals``; anything else is refused with its name, and no
code in the file runs.
Because every rank file holds an even, contiguous slice of each flattened parameter, loading
on another world size or stage only means reading the byte ranges that overlap the slices a
rank needs now. Writes are atomic: the files go to ``<tag>.tmp-<id>/``, which rank 0 renames
to ``<tag>`` once every rank has written and fsync'ed its part; ``latest`` is replaced last.

How the modules divide the work:

* ``_format``: names, version, file naming, dtype names, JSON encoding of values.
* ``_paths``: which paths a checkpoint may name and which files a load may open (tags are
  plain names, files regular and inside the directory).
* ``_agreement``: a failure on one rank is raised on every rank, after each phase, so no
  rank waits in a collective that another never joins.
* ``_engine_state``: the one module that reads and writes the engine (module, parameters and
  their shards, optimizer, scheduler, loss scaler, data loader, counters, precision, config).
* ``_client_state``: the user's ``client_state``, split into JSON, tensors and pickled objects.
* ``_manifest``: meta.json. ``_staging``: what each rank writes, checked before any write.
* ``_mesh_values``: between this rank's tensors and the unsplit model on a device mesh
  (tensor-parallel slices, optimizer slices over a data-parallel group).
* ``_safetensors_writer``: rank files written from the tensors' memory, with per-tensor checksums.
* ``_saving``: the phases of a save and the atomic publication of the directory;
  ``_background``: the one save that may run in a thread (``checkpoint.async_save``).
* ``_reading``: the tag, meta.json, verified byte ranges of the rank files; ``_integrity``:
  meta.json checked against the rank files' headers (sizes, CRC32s, ranges).
* ``_loading``: what each rank reads and checks; ``_applying``: putting it into the engine.
* ``_consolidation``: full weights in one process.
* DeepSpeed's checkpoints: ``_deepspeed_files`` (finding them; torch's restricted unpickler
  with stand-ins for DeepSpeed's types), ``_deepspeed_layout`` (flat partitions),
  ``_deepspeed_state`` (what one holds), ``_deepspeed_stage0`` (naming stage 0's optimizer
  indices), ``_deepspeed_pipe`` (a pipeline's stages and its layer files under the unsplit
  module's names), ``_deepspeed_reader`` (every layout); ``_import``: that state written as a
  shardtrain checkpoint by :func:`save_checkpoint`; :mod:`.deepspeed_keys`: the keys read,
  by DeepSpeed's names (public: the alias's ``deepspeed.checkpoint.constants`` re-exports
  them); ``_universal``: ``engine.load_checkpoint`` on a DeepSpeed directory (``latest``,
  or ``latest_universal`` with ``checkpoint.load_universal``).
* ``_export_plan`` and ``_export``: the Hugging Face layout (shards, index, config.json),
  planned from meta.json, then streamed tensor by tensor with bounded memory.

Example:
    >>> engine.save_checkpoint("checkpoints")                  # tag global_step<N>, on all ranks
    >>> path, client = engine.load_checkpoint("checkpoints")   # the tag named by ``latest``
    >>> consolidate("checkpoints", "model.safetensors")        # one process, no group needed
    >>> import_deepspeed("ds_checkpoints", "checkpoints")      # DeepSpeed's, to this format
    >>> export_pretrained("checkpoints", "hf-model", max_shard_size="5GB")  # from_pretrained
"""
from ._background import wait_for_checkpoint
from ._consolidation import consolidate, full_weights
from ._export import export_pretrained
from ._format import FORMAT_VERSION
from ._import import import_deepspeed
from ._loading import load_checkpoint
from ._saving import save_checkpoint
from ._universal import load_universal

__all__ = ["consolidate", "full_weights", "export_pretrained", "save_checkpoint",
           "load_checkpoint", "import_deepspeed", "FORMAT_VERSION", "wait_for_checkpoint",
           "load_universal"]
