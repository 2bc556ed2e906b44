"""Constants several layers share (no imports): ImageNet normalisation, as timm.data.constants."""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Seeds are in [0, 2**32): PyTorch's CPU generator (a Mersenne Twister) reads a seed's low 32 bits only, so
# seeds 2**32 apart gave the same run (numpy's legacy seeding takes the same range).
SEED_LIMIT = 2**32
