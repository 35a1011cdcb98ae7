"""`--data-backend dali`: NVIDIA DALI decodes, crops, resizes, flips and normalises each batch, on the GPU where there
is one (the "mixed" decoder: nvJPEG, the A100's hardware decoder; GPU operators after it), else with DALI's CPU
operators. The samples are the template's own sampler's: the DataLoader's workers read each file's bytes and header
and draw the sample's crop box and flip from (seed, epoch, index) as the torchvision backend does (data.decoded);
the batch's bytes, boxes and flips reach the DALI pipeline through `fn.external_source`, so the plan, exact resume
and elastic resume hold, and a sample gets the same crop on any backend and at any world size. DALI's decoders and
resize round differently from libjpeg-turbo's and torch's: the batches equal the torchvision backend's within a few
levels of 255 (tests/test_dali.py measures it).

DALI is an extra (`pip install -e '.[dali]'`, the `nvidia-dali-cuda120` wheel), imported only when this backend
is chosen.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import torch

from ddp_tricks.data.decoded import MEAN, STD
from ddp_tricks.data.gpu_decode import EncodedImages
from ddp_tricks.errors import UserError

INSTALL = (
    "pip install -e '.[dali]' (the nvidia-dali-cuda120 wheel; for CUDA 13: pip install nvidia-dali-cuda130; "
    "PyPI's plain nvidia-dali is a placeholder)"
)
THREADS = 4  # DALI's CPU threads per process: the CPU pipeline's decoders, the mixed decoder's Huffman decoding


def check() -> None:
    """NVIDIA DALI importable, or one line saying how to install it."""
    import importlib.util

    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        raise UserError(f"--data-backend dali needs NVIDIA DALI, which is not installed: {INSTALL}")
    try:
        import nvidia.dali  # noqa: F401
    except (ImportError, OSError) as error:
        raise UserError(f"--data-backend dali: NVIDIA DALI does not load ({error}); reinstall it: {INSTALL}") from None


def validation_geometry(width: int, height: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The reference's Resize(size x 256 / 224) of an image of width x height then CenterCrop(size), as torchvision
    computes them: the resized (height, width) (the shorter side to the target, the longer truncated) and the crop's
    (top, left)."""
    resize = int(size * 256 / 224)
    if width <= height:
        new_width, new_height = resize, int(resize * height / width)
    else:
        new_width, new_height = int(resize * width / height), resize
    return (new_height, new_width), (int(round((new_height - size) / 2.0)), int(round((new_width - size) / 2.0)))


class DaliImages(EncodedImages):
    """An ImageNet-style folder whose samples are (the file's bytes, its geometry, the flip); `finish` runs the batch
    through a DALI pipeline on the device given (the CPU's operators on the CPU). A training sample's geometry is its
    crop box (top, left, height, width); a validation sample's the resized size and the centre crop's corner."""

    backend = "data backend dali: the batch decoded and augmented by NVIDIA DALI"

    def __init__(self, root: str, size: int, train: bool, draft: bool = True, seed: int = 0, threads: int = THREADS):
        super().__init__(root, size, train, draft, seed)
        self.threads = threads
        self._pipelines: dict = {}

    def __getstate__(self):
        return {**self.__dict__, "_pipelines": {}}  # DataLoader workers only read files: they get no pipeline

    def describe(self) -> str:
        return f"image folder of {len(self)} images at {self.size} px, {self.backend}, normalised on the device"

    def __getitem__(self, index: int):
        from PIL import Image

        path, label = self.samples[index]
        try:
            data = Path(path).read_bytes()
            width, height = Image.open(io.BytesIO(data)).size  # the header only
        except (OSError, ValueError, SyntaxError) as error:
            raise UserError(f"cannot read the image {path!r} ({error}): remove or replace the file") from None
        if self.train:
            box, flip = self.box_and_flip(index, width, height)
        else:
            (h, w), (top, left) = validation_geometry(width, height, self.size)
            box, flip = (top, left, h, w), False
        return (torch.frombuffer(bytearray(data), dtype=torch.uint8), box, flip), label

    def _pipeline(self, device: torch.device, batch_size: int):
        """This process's pipeline for `device` holding at least `batch_size` samples (built again, larger, for a
        larger batch)."""
        key = (device.type, device.index)
        pipeline = self._pipelines.get(key)
        if pipeline is None or pipeline.max_batch_size < batch_size:
            on_gpu = device.type == "cuda"
            device_id = (device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else None
            pipeline = build_pipeline(self.train, self.size, on_gpu, batch_size, self.threads, device_id)
            self._pipelines[key] = pipeline
        return pipeline

    def finish(self, inputs, device: torch.device, channels_last: bool = False) -> torch.Tensor:
        """The batch decoded, cropped, resized, flipped and normalised by DALI on `device`: float32 (N, 3, H, W),
        channels-last memory or contiguous. On a GPU DALI's output is copied on the current stream (the Feed's side
        stream)."""
        encoded, boxes, flips = inputs
        pipeline = self._pipeline(device, len(encoded))
        pipeline.feed_input("encoded", [np.asarray(image.numpy()) for image in encoded])
        pipeline.feed_input("corner", [np.array(box[:2], dtype=np.float32) for box in boxes])
        pipeline.feed_input("extent", [np.array(box[2:], dtype=np.float32) for box in boxes])
        pipeline.feed_input("flip", [np.array(int(flip), dtype=np.int32) for flip in flips])
        # on a GPU the outputs are bound to the current stream (the Feed's side stream): no wait on the host
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        try:
            (images,) = pipeline.run(stream)
        except RuntimeError as error:  # a file DALI cannot decode; its pipeline is no longer usable
            self._pipelines.clear()
            raise UserError(
                f"NVIDIA DALI cannot decode a batch ({_cause(error)}): --data-backend torchvision names the file"
            ) from None
        if device.type == "cuda":
            from nvidia.dali.plugin.pytorch import feed_ndarray

            out = torch.empty((len(encoded), self.size, self.size, 3), dtype=torch.float32, device=device)
            feed_ndarray(images.as_tensor(), out, cuda_stream=stream)
        else:
            out = torch.from_numpy(images.as_array())  # a copy DALI no longer owns
        images = out.permute(0, 3, 1, 2)  # (N, H, W, 3) memory: channels-last already
        return images if channels_last else images.contiguous()


def _cause(error: Exception) -> str:
    """DALI's reason, the line after its operator's traceback ("encountered:")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    after = [lines[k + 1] for k, line in enumerate(lines[:-1]) if line == "encountered:"]
    return (after or lines or [type(error).__name__])[0]


def build_pipeline(train: bool, size: int, on_gpu: bool, batch_size: int, threads: int, device_id: int | None):
    """The DALI pipeline of a batch: external sources for the encoded files, each sample's corner and extent (the
    crop box's (top, left) and (height, width) for training; the resized (height, width) and the centre crop's
    (top, left) for validation) and its flip; decode (of the box only, for training), resize (linear, antialiased),
    crop, flip and normalise, as float32 (N, H, W, 3)."""
    from nvidia.dali import fn, pipeline_def, types

    decoder = "mixed" if on_gpu else "cpu"

    threads = max(1, min(threads, os.cpu_count() or 1))

    # one batch at a time: the Feed asks for the next batch only when it has fed it (its side stream runs ahead)
    @pipeline_def(
        batch_size=batch_size, num_threads=threads, device_id=device_id, prefetch_queue_depth=1, exec_dynamic=True
    )
    def pipeline():
        encoded = fn.external_source(name="encoded", dtype=types.UINT8)
        corner = fn.external_source(name="corner", dtype=types.FLOAT)
        extent = fn.external_source(name="extent", dtype=types.FLOAT)
        flip = fn.external_source(name="flip", dtype=types.INT32)
        if train:
            images = fn.decoders.image_slice(
                encoded,
                corner,
                extent,
                device=decoder,
                output_type=types.RGB,
                axis_names="HW",
                normalized_anchor=False,
                normalized_shape=False,
            )
            images = fn.resize(images, size=[size, size], interp_type=types.INTERP_LINEAR, antialias=True)
        else:
            images = fn.decoders.image(encoded, device=decoder, output_type=types.RGB)
            images = fn.resize(images, size=extent, interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.slice(
                images,
                corner,
                np.array([size, size], dtype=np.float32),
                axis_names="HW",
                normalized_anchor=False,
                normalized_shape=False,
            )
        return fn.crop_mirror_normalize(
            images,
            mirror=flip,
            dtype=types.FLOAT,
            output_layout="HWC",
            mean=[255 * m for m in MEAN],
            std=[255 * s for s in STD],
        )

    built = pipeline()
    built.build()
    return built
