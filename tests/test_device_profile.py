"""DeviceProfile: DeepPool A100 profile parsing, DeepPool keys for our modules, JSON round trip."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tidal
from tidal.ir.device_profile import DeviceProfile, LayerTime, generic_signature, layer_signature

DATA = Path(tidal.__file__).resolve().parent.parent / "shared" / "data" / "deeppool-a100-profiles"
needs_data = pytest.mark.skipif(
    not DATA.is_dir(), reason=f"DeepPool A100 profiles not found at {DATA}"
)
PROF_FILES = ("A100_vgg.prof", "A100_inception.prof", "A100_wrn.prof")
TXT_FILES = tuple(sorted(p.name for p in DATA.glob("*LayerGpuProfileA100*.txt"))) if DATA.is_dir() else ()

VGG_CONV1_64 = (
    'conv2d{"in_channels":3,"kernel_size":3,"out_channels":64,"padding":1,"stride":1}[64][3,224,224]'
)


def _vgg16_leaves() -> list[nn.Module]:
    """VGG-16 (cfg D) leaf modules in execution order, on the meta device."""
    with torch.device("meta"):
        try:
            from examples.models import vgg16
        except ImportError:
            vgg16 = None
        if vgg16 is not None:
            m = vgg16()
            return list(m.features) + [m.avgpool, nn.Flatten()] + list(m.classifier)
        layers: list[nn.Module] = []
        channels = 3
        for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                  512, 512, 512, "M"):
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU(inplace=True)]
                channels = v
        return layers + [nn.Flatten(), nn.Linear(25088, 4096), nn.ReLU(True), nn.Dropout(),
                         nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, 1000)]


def _signatures(leaves: list[nn.Module], input_shape: tuple[int, ...], batch: int):
    x = torch.empty((batch,) + input_shape, device="meta")
    out = []
    for mod in leaves:
        out.append((mod, layer_signature(mod, tuple(x.shape[1:]), batch)))
        x = mod(x)
    return out


@needs_data
@pytest.mark.parametrize("name", PROF_FILES + TXT_FILES)
def test_every_published_file_loads(name):
    prof = DeviceProfile.from_deeppool(DATA / name)
    assert len(prof) > 10
    assert prof.name == f"deeppool:{Path(name).stem}"
    assert all(t.fwd_us >= 0 and t.bwd_us >= 0 for t in prof.entries.values())


@needs_data
def test_prof_rows_read_as_forward_and_backward_microseconds():
    vgg = DeviceProfile.from_deeppool(DATA / "A100_vgg.prof")
    # line 71: linear{...25088->4096}[32]25088   0.336   335   1
    assert vgg.lookup(
        'linear{"bias":true,"in_features":25088,"out_features":4096}[32]25088'
    ) == LayerTime(335, 1)
    inception = DeviceProfile.from_deeppool(DATA / "A100_inception.prof")
    # line 1: conv2d{...3->32 stride 2}[64][3,299,299]   1.599   249   1350
    row = inception.lookup(
        'conv2d{"in_channels":3,"kernel_size":3,"out_channels":32,"padding":0,"stride":2}[64][3,299,299]'
    )
    assert (row.fwd_us, row.bwd_us, row.total_us) == (249.0, 1350.0, 1599.0)
    # non-square kernels are lists in the key (line 45)
    assert inception.lookup(
        'conv2d{"in_channels":128,"kernel_size":[1,7],"out_channels":192,"padding":[0,3],'
        '"stride":1}[64][128,17,17]'
    ) == LayerTime(110, 236)


@needs_data
def test_repeated_key_keeps_last_row_like_deeppool():
    vgg = DeviceProfile.from_deeppool(DATA / "A100_vgg.prof")
    # lines 2 and 4 share a key (1205/3730, then 1205/14103); DeepPool's dict keeps the last
    key = 'ReLU2d{"inplace":true,"kernel_size":1,"padding":0,"stride":1}[64][64,224,224]'
    assert vgg.lookup(key) == LayerTime(1205, 14103)


@needs_data
def test_txt_total_split_one_third_forward():
    prof = DeviceProfile.from_deeppool(DATA / "vggLayerGpuProfileA100.txt")
    # line 2: conv2d{...3->64}[128][3,224,224]  13.509 (avg ms)  p50 p90 p99
    t = prof.lookup(VGG_CONV1_64.replace("[64][3,224,224]", "[128][3,224,224]"))
    assert t.total_us == pytest.approx(13509.0)
    assert t.fwd_us == pytest.approx(13509.0 / 3) and t.bwd_us == pytest.approx(2 * 13509.0 / 3)


@needs_data
def test_vgg16_first_conv_found_at_batch_64():
    sig = layer_signature(nn.Conv2d(3, 64, kernel_size=3, padding=1), (3, 224, 224), 64)
    assert sig == VGG_CONV1_64
    assert DeviceProfile.from_deeppool(DATA / "A100_vgg.prof").lookup(sig) == LayerTime(2157, 6)


@needs_data
def test_vgg16_layers_at_batch_32_match_rows():
    prof = DeviceProfile.from_deeppool(DATA / "A100_vgg.prof")
    sigs = _signatures(_vgg16_leaves(), (3, 224, 224), 32)
    found = {type(m).__name__: [0, 0] for m, _ in sigs}
    for mod, sig in sigs:
        found[type(mod).__name__][0] += sig is not None and sig in prof
        found[type(mod).__name__][1] += 1
    assert found["Conv2d"] == [13, 13]
    assert found["MaxPool2d"] == [5, 5]
    assert found["Linear"] == [3, 3]
    assert found["ReLU"] == [15, 15]  # 13 ReLU2d after convs, 2 ReLU1d after linears
    # Dropout (and the zoo's 7x7 AdaptiveAvgPool2d) have no row: DeepPool's VGG has neither
    assert found["Dropout"][0] == 0


@needs_data
def test_wide_resnet_bottlenecks_match_rows():
    models = pytest.importorskip("examples.models")
    prof = DeviceProfile.from_deeppool(DATA / "A100_wrn.prof")
    with torch.device("meta"):
        m = models.wide_resnet101_2()
    x = m.maxpool(m.relu(m.bn1(m.conv1(torch.empty(32, 3, 224, 224, device="meta")))))
    blocks = [b for stage in (m.layer1, m.layer2, m.layer3, m.layer4) for b in stage]
    sigs = []
    for block in blocks:
        sigs.append(layer_signature(block, tuple(x.shape[1:]), 32))
        x = block(x)
    assert sigs[0] == (
        'ResnetBottleneck{"base_width":128,"dilation":1,"downsampleParams":[[64,256,1],256],'
        '"groups":1,"inplanes":64,"planes":64,"stride":1}[32][64,56,56]'
    )
    assert [s in prof for s in sigs] == [True] * 33


def test_layer_signature_formats_and_unsupported_kinds():
    lin = layer_signature(nn.Linear(4096, 1000), (4096,), 8)
    assert lin == 'linear{"bias":true,"in_features":4096,"out_features":1000}[8]4096'
    assert layer_signature(nn.ReLU(), (10,), 2).startswith('ReLU1d{"inplace":false')
    assert layer_signature(nn.Conv2d(8, 8, (1, 7), padding=(0, 3)), (8, 17, 17), 4) == (
        'conv2d{"in_channels":8,"kernel_size":[1,7],"out_channels":8,"padding":[0,3],"stride":1}'
        '[4][8,17,17]'
    )
    assert layer_signature(nn.AdaptiveAvgPool2d(1), (2048, 7, 7), 4) == (
        'adAvgPool2d{"output_height":1,"output_width":1}[4][2048,7,7]'
    )
    assert layer_signature(nn.BatchNorm2d(8), (8, 4, 4), 2) is None
    assert layer_signature(nn.Conv2d(8, 8, 3, groups=8), (8, 4, 4), 2) is None
    with pytest.raises(ValueError, match="batch=0"):
        layer_signature(nn.ReLU(), (3,), 0)
    with pytest.raises(ValueError, match="input_shape"):
        layer_signature(nn.ReLU(), (3, -1), 1)


def test_json_round_trip_and_immutability(tmp_path):
    prof = DeviceProfile("p", {VGG_CONV1_64: LayerTime(2157, 6), "x": LayerTime(0.1 + 0.2, 1 / 3)})
    text = prof.to_json()
    back = DeviceProfile.from_json(text)
    assert back == prof and back.to_json() == text and hash(back) == hash(prof)
    assert back.lookup("x").fwd_us == 0.1 + 0.2  # floats survive exactly
    prof.save(tmp_path / "sub" / "p.json")
    assert DeviceProfile.load(tmp_path / "sub" / "p.json") == prof
    with pytest.raises(TypeError):
        prof.entries["y"] = LayerTime(1, 1)  # type: ignore[index]
    merged = prof.merged(DeviceProfile("q", {"x": LayerTime(5, 5), "z": LayerTime(1, 2)}))
    assert len(merged) == 3 and merged.lookup("x") == LayerTime(5, 5) and merged.name == "p+q"
    assert "z" in merged and prof.lookup("z") is None
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        LayerTime(-1, 0)
    with pytest.raises(ValueError, match="entry 'x'"):
        DeviceProfile.from_json(text.replace("0.30000000000000004", '"a"'))


@needs_data
def test_published_profile_round_trips_json():
    prof = DeviceProfile.from_deeppool(DATA / "A100_inception.prof")
    assert DeviceProfile.from_json(prof.to_json()) == prof


@pytest.mark.parametrize("bad, message", [
    ("conv2d{\"a\":1}[4][3,8,8]   0.1   50\n", r"bad\.prof:3: expected a layer key and 3 numbers"),
    ("conv2d{\"a\":1}[4][3,8,8]   0.1   50   x\n", r"bad\.prof:3: non-numeric"),
    ("conv2d[4][3,8,8]   0.1   50   50\n", r"bad\.prof:3: .* is not a DeepPool layer key"),
    ("conv2d{\"a\":}[4][3,8,8]   0.1   50   50\n", r"bad\.prof:3: bad JSON"),
    ("conv2d{\"a\":1}[4][3,8,8]   0.1   50   -5\n", r"bad\.prof:3: .*>= 0"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, message):
    path = tmp_path / "bad.prof"
    path.write_text('conv2d{"a":1}[4][3,8,8]   0.1   50   50\n\n' + bad)
    with pytest.raises(ValueError, match=message):
        DeviceProfile.from_deeppool(path)


def test_unknown_suffix_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"expected a \.prof or \.txt file"):
        DeviceProfile.from_deeppool(tmp_path / "x.csv")


def test_generic_signature_is_deterministic_across_processes():
    code = (
        "import torch; from tidal.ir.device_profile import generic_signature as g; "
        "print(g(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()), "
        "[torch.zeros(2, 3, 8, 8, dtype=torch.float16), (5,), None], 2, args='(T,1)'))"
    )
    here = generic_signature(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()),
                             [torch.zeros(2, 3, 8, 8, dtype=torch.float16), (5,), None], 2,
                             args="(T,1)")
    package_parent = str(Path(tidal.__path__[0]).parent)  # where `import tidal` resolved
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [package_parent, os.environ.get("PYTHONPATH", "")])))
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, check=True).stdout.strip()
    assert other == here
    assert here.endswith(" | (T,1) | B=2 | float16[2,3,8,8],?[5],-")
