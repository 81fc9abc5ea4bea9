// Python bindings of mlx_streaming._ext: only glue, the work is in the
// other files.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>

#include "mlx/version.h"

#include "crc32.h"
#include "paged.h"
#include "reader.h"
#include "staging.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace mlx_streaming;

namespace {

template <typename T, int D>
using CArray = nb::ndarray<const T, nb::ndim<D>, nb::c_contig, nb::device::cpu>;
// A writable array Python owns and the native side updates in place.
template <typename T, int D>
using MArray = nb::ndarray<T, nb::ndim<D>, nb::c_contig, nb::device::cpu>;

std::vector<Segment> to_segments(const CArray<int64_t, 2>& segs) {
  if (segs.shape(1) != 2) {
    throw std::invalid_argument("segments must be [S, 2] (offset, nbytes)");
  }
  std::vector<Segment> out(segs.shape(0));
  for (size_t j = 0; j < out.size(); ++j) {
    out[j] = {segs.data()[2 * j], segs.data()[2 * j + 1]};
  }
  return out;
}

template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T> v) {
  auto* data = new std::vector<T>(std::move(v));
  nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(data->data(), {data->size()}, owner);
}

// The Python face of a reader: owns the C++ reader through a shared_ptr so
// staging areas and in-flight tasks keep it alive.
struct PyReader {
  std::shared_ptr<ExpertReader> reader;
};

} // namespace

NB_MODULE(_ext, m) {
  m.doc() = "mlx_streaming native expert I/O, prefetch staging and paged bookkeeping";
  nb::module_::import_("mlx.core");

  m.attr("mlx_version") = std::to_string(MLX_VERSION_MAJOR) + "." +
      std::to_string(MLX_VERSION_MINOR) + "." + std::to_string(MLX_VERSION_PATCH);
#ifdef _METAL_
  m.attr("metal") = true;
#else
  m.attr("metal") = false;
#endif

  nb::exception<ReadError>(m, "ReadError");

  // The named types of the contract with runtime/store.py.
  nb::enum_<Checksums>(m, "Checksums", "When a paged layer checks a record's checksum.")
      .value("off", Checksums::Off)
      .value("first_read", Checksums::FirstRead)
      .value("always", Checksums::Always);
  nb::enum_<Failure>(m, "Failure", "What failed in a call made inside the graph.")
      .value("none", Failure::None)
      .value("read", Failure::Read)
      .value("checksum", Failure::Checksum)
      .value("other", Failure::Other);
  nb::class_<PagedError>(m, "PagedError")
      .def_ro("kind", &PagedError::kind)
      .def_ro("expert", &PagedError::expert)
      .def_ro("message", &PagedError::message);
  nb::class_<PagedCounters>(m, "Counters", "What a layer's calls inside the graph did.")
      .def_ro("calls", &PagedCounters::calls)
      .def_ro("tokens", &PagedCounters::tokens)
      .def_ro("hits", &PagedCounters::hits)
      .def_ro("misses", &PagedCounters::misses)
      .def_ro("distinct", &PagedCounters::distinct)
      .def_ro("records", &PagedCounters::records)
      .def_ro("read_s", &PagedCounters::read_s)
      .def_ro("stall_s", &PagedCounters::stall_s);
  nb::class_<EnsureResult>(m, "Ensured", "What making experts resident did.")
      .def_ro("read", &EnsureResult::read, "records read")
      .def_ro("bad", &EnsureResult::bad, "an expert whose checksum failed, or -1")
      .def_ro("read_s", &EnsureResult::read_s, "seconds in the reader")
      .def_ro("load_s", &EnsureResult::load_s, "seconds of the stall");

  nb::class_<Staging>(m, "Staging")
      .def(
          "stage",
          [](Staging& s, int layer, int file, CArray<int64_t, 1> experts,
             CArray<int64_t, 1> offsets) {
            nb::gil_scoped_release release;
            return s.stage(layer, file, experts.data(), offsets.data(), experts.shape(0));
          },
          "layer"_a, "file"_a, "experts"_a, "offsets"_a)
      .def(
          "take",
          [](Staging& s, int layer, int64_t expert, CArray<int64_t, 2> segments,
             CArray<int64_t, 1> dst_row, bool want_crc) {
            auto segs = to_segments(segments);
            nb::gil_scoped_release release;
            return s.take(layer, expert, segs, dst_row.data(), want_crc);
          },
          "layer"_a, "expert"_a, "segments"_a, "dst_row"_a, "want_crc"_a)
      .def("drop", &Staging::drop, "layer"_a)
      .def("cancelled", &Staging::cancelled, "Staged reads cancelled before they started.");

  nb::class_<PyReader>(m, "ExpertReader")
      .def(
          "__init__",
          [](PyReader* self, int threads, bool direct, double pace_bytes_per_s) {
            new (self) PyReader{std::make_shared<ExpertReader>(threads, direct, pace_bytes_per_s)};
          },
          "threads"_a, "direct"_a, "pace_bytes_per_s"_a = 0.0,
          "pace_bytes_per_s > 0: every read ends no earlier than a disk of that rate "
          "would end it (benchmarks: ReadPace)")
      .def_prop_ro("threads", [](PyReader& r) { return r.reader->threads(); })
      .def_prop_ro("direct", [](PyReader& r) { return r.reader->direct(); })
      .def(
          "busy", [](PyReader& r) { return r.reader->meter().totals(); },
          "(bytes read, seconds with a read in flight) since the reader was made.")
      .def("open", [](PyReader& r, const std::string& path) { return r.reader->open(path); })
      .def("close", [](PyReader& r) { r.reader->close(); })
      .def(
          "drain",
          [](PyReader& r) {
            nb::gil_scoped_release release;
            r.reader->pool().drain();
          },
          "Wait until no read is queued or running.")
      .def(
          "read",
          [](PyReader& r, int file, CArray<int64_t, 1> offsets, CArray<int64_t, 2> segments,
             CArray<int64_t, 2> dst, CArray<bool, 1> checksum, int64_t stride) {
            auto segs = to_segments(segments);
            size_t n = offsets.shape(0);
            if (dst.shape(0) != n || dst.shape(1) != segs.size() || checksum.shape(0) != n) {
              throw std::invalid_argument("read: offsets, dst and checksum disagree in shape");
            }
            std::vector<uint32_t> crcs;
            {
              nb::gil_scoped_release release;
              crcs = r.reader->read(file, offsets.data(), n, segs, dst.data(),
                                    checksum.data(), stride);
            }
            return to_numpy(std::move(crcs));
          },
          "file"_a, "offsets"_a, "segments"_a, "dst"_a, "checksum"_a, "stride"_a)
      .def(
          "paged_index",
          [](PyReader& r, int file, int64_t stride, CArray<int64_t, 2> segments, double decay,
             double shadow_decay, double lru_margin, Checksums checksums, std::string blob) {
            return std::make_shared<PagedIndex>(r.reader, file, stride, to_segments(segments),
                                                decay, shadow_decay, lru_margin, checksums,
                                                std::move(blob));
          },
          "file"_a, "stride"_a, "segments"_a, "decay"_a, "shadow_decay"_a, "lru_margin"_a,
          "checksums"_a,
          "blob"_a,
          "The native bookkeeping of one paged layer reading `file` (store.NativeStore).")
      .def(
          "staging",
          [](PyReader& r, int capacity, int64_t stride) {
            return std::make_shared<Staging>(r.reader, capacity, stride);
          },
          "capacity"_a, "stride"_a);

  // Made by ExpertReader.paged_index, owned through shared_ptrs: the MLX
  // stream thread that drops a finished remap releases a plain C++ object
  // and never needs the GIL.
  nb::class_<PagedIndex>(m, "PagedIndex")
      .def(
          "bind",
          [](PagedIndex& p, MArray<int32_t, 1> slot_of_expert, MArray<int64_t, 1> expert_of_slot,
             CArray<int64_t, 2> addresses, MArray<double, 1> last_use,
             std::optional<MArray<double, 1>> score, CArray<uint32_t, 1> checksums,
             MArray<bool, 1> unchecked, std::optional<MArray<bool, 2>> shadow,
             std::optional<MArray<double, 1>> misses) {
            size_t experts = slot_of_expert.shape(0), slots = expert_of_slot.shape(0);
            bool ok = addresses.shape(0) == slots && addresses.shape(1) == p.segments() &&
                last_use.shape(0) == experts + 1 &&
                checksums.shape(0) == experts && unchecked.shape(0) == experts &&
                (!score || score->shape(0) == experts + 1) &&
                // The adaptive policy: both shadows, its misses and a score.
                (!shadow == !misses) && (!shadow || (score && shadow->shape(0) == 2 &&
                                                     shadow->shape(1) == experts + 1 &&
                                                     misses->shape(0) == 2));
            if (!ok) {
              throw std::invalid_argument("bind: table, slot and policy arrays disagree in shape");
            }
            p.bind({slot_of_expert.data(), expert_of_slot.data(), addresses.data(),
                    last_use.data(), score ? score->data() : nullptr,
                    shadow ? shadow->data() : nullptr, misses ? misses->data() : nullptr,
                    checksums.data(), unchecked.data(), static_cast<int64_t>(experts),
                    static_cast<int64_t>(slots)});
          },
          // noconvert: a converted temporary would be freed when bind returns.
          "slot_of_expert"_a.noconvert(), "expert_of_slot"_a.noconvert(),
          "addresses"_a.noconvert(), "last_use"_a.noconvert(), "score"_a.noconvert().none(),
          "checksums"_a.noconvert(), "unchecked"_a.noconvert(),
          "shadow"_a.noconvert().none() = nb::none(), "misses"_a.noconvert().none() = nb::none(),
          "Borrow the pool's tables and the policy's scores (rebind after a resize).")
      .def("unbind", &PagedIndex::unbind,
           "Forget the borrowed arrays (the model is closing).")
      .def_prop_rw("clock", &PagedIndex::clock, &PagedIndex::set_clock,
                   "The policy's call counter (last_use values).")
      .def(
          "route",
          [](PagedIndex& p, nb::ndarray<const uint32_t, nb::c_contig, nb::device::cpu> ids) {
            std::vector<int64_t> experts;
            int64_t hits = p.route(ids.data(), ids.size(), experts);
            return std::make_tuple(hits, to_numpy(std::move(experts)));
          },
          "ids"_a, "(hits, distinct experts) of a call's ids; the policy observes it.")
      .def(
          "ensure",
          [](PagedIndex& p, CArray<int64_t, 1> experts) {
            EnsureResult r;
            {
              nb::gil_scoped_release release;
              r = p.ensure(experts.data(), experts.shape(0));
            }
            return r;
          },
          "experts"_a, "Make `experts` resident (an Ensured).")
      .def(
          "take_counters",
          &PagedIndex::take_counters,
          "The Counters of the calls made in the graph since the last take; resets them.")
      .def(
          "take_error",
          [](PagedIndex& p) -> std::optional<PagedError> {
            PagedError e = p.take_error();
            if (e.kind == Failure::None) {
              return std::nullopt;
            }
            return e;
          },
          "The first failure (a PagedError) of a call made in the graph, or None; resets it.");

  m.def(
      "paged_remap",
      [](const mx::array& ids, const mx::array& table, std::shared_ptr<PagedIndex> index) {
        return paged_remap(ids, table, std::move(index));
      },
      "ids"_a, "table"_a, "index"_a,
      "The slot of each id once `index` made them resident, computed in the graph "
      "(CPU backend): no host sync.");

  m.def(
      "crc32",
      [](nb::bytes data, uint32_t crc) {
        return mlx_streaming::crc32(crc, reinterpret_cast<const uint8_t*>(data.c_str()), data.size());
      },
      "data"_a, "crc"_a = 0, "CRC-32 with zlib's polynomial (for tests).");
}
