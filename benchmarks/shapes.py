"""Parameter shapes of real models, generated from their architectures (no model code needed)."""


def gpt2_small():
    """GPT-2 124M: 148 tensors, 124,439,808 parameters."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def resnet50():
    """ResNet-50: 161 tensors (53 convolutions, 53 batch norms with weight and bias, the classifier)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            out_ch = width * 4
            shapes += [(width, in_ch, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (out_ch, width, 1, 1), (out_ch,), (out_ch,)]
            if b == 0:
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    return shapes + [(1000, 2048), (1000,)]
