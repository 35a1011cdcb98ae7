"""`--data-backend gpu-decode`: the DataLoader workers read each JPEG's bytes and header only (its size, for the crop
box that data.decoded draws from (seed, epoch, index), as the torchvision backend does); the batch is decoded on the
GPU by torchvision's batched `decode_jpeg(device="cuda")` (nvJPEG), then cropped, resized (antialiased), flipped and
normalised there. Files decode_jpeg does not take (PNG, grayscale, CMYK) are decoded by PIL in the workers and travel
as pixels. The samples and their order are the template's own sampler's, so exact resume and the plan hold.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from ddp_tricks.data.decoded import DecodedImages, on_device, read_image
from ddp_tricks.errors import UserError


class EncodedImages(DecodedImages):
    """DecodedImages whose samples are (the file's bytes or PIL's pixels, the crop box, the flip), finished into the
    model's input batch by `finish` on the device given (decode, crop, resize, flip, normalise)."""

    backend = "data backend gpu-decode: the batch decoded on the device by decode_jpeg"
    repeats = False  # the default recipe only (images.image_folders): no --aug-repeats

    def __getitem__(self, index: int):
        from PIL import Image

        path, label = self.samples[index]
        try:
            data = Path(path).read_bytes()
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            box, flip = self.box_and_flip(index, width, height)
            if image.format == "JPEG" and image.mode == "RGB":
                return (torch.frombuffer(bytearray(data), dtype=torch.uint8), box, flip), label
        except (OSError, ValueError, SyntaxError) as error:
            raise UserError(f"cannot read the image {path!r} ({error}): remove or replace the file") from None
        pixels, _ = read_image(path, lambda w, h: box, (self.size, self.size), draft=False)
        return (pixels, box, flip), label

    @staticmethod
    def collate(samples):
        """((encoded or decoded images, boxes, flips), labels): the images as a list (each its own size)."""
        images = [image for (image, _, _), _ in samples]
        boxes = [box for (_, box, _), _ in samples]
        flips = [flip for (_, _, flip), _ in samples]
        return (images, boxes, flips), torch.tensor([label for _, label in samples], dtype=torch.long)

    def finish(self, inputs, device: torch.device, channels_last: bool = False) -> torch.Tensor:
        """The batch decoded on `device` (batched decode_jpeg; the CPU's where device is the CPU), each image
        cropped and resized as the torchvision backend does it, flipped, stacked and normalised."""
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms.v2 import functional as F

        images, boxes, flips = inputs
        encoded = [k for k, image in enumerate(images) if image.dim() == 1]
        decoded = decode_jpeg([images[k] for k in encoded], mode=ImageReadMode.RGB, device=device) if encoded else []
        pixels = list(images)
        for k, image in zip(encoded, decoded):
            pixels[k] = image
        out = []
        for image, box, flip in zip(pixels, boxes, flips):
            image = image.to(device, non_blocking=True)
            if self.train:
                image = F.resized_crop(image, *box, [self.size, self.size], antialias=True)
            else:
                resize = int(self.size * 256 / 224)
                image = F.center_crop(F.resize(image, resize, antialias=True), [self.size, self.size])
            out.append(F.horizontal_flip(image) if flip else image)
        return on_device(torch.stack(out), torch.float32, channels_last)


def check_backend(backend: str) -> None:
    """gpu-decode without CUDA is one line, before any process group (data.dali.check says dali's)."""
    if backend == "gpu-decode" and not torch.cuda.is_available():
        raise UserError(
            "--data-backend gpu-decode decodes JPEGs on the GPU (torchvision's decode_jpeg on CUDA) and no CUDA "
            "device is visible: run on a GPU, or use --data-backend torchvision"
        )
