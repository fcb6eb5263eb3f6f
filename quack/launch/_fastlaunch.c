/* The kernel launcher's per-call work in C: read each tensor through torch's
 * DLPack C exchange interface, write its fields into the packed argument
 * buffer, call the exported object's entry point.
 *
 * Python (quack/launch/launcher.py) decides everything once per kernel: where
 * each field goes (byte offsets in the buffer), the pointer array the entry
 * point takes, and the entry point's address.  This module only repeats the
 * writes on every call, so a launch costs no per-argument Python.
 *
 * No torch or CUDA headers: the few DLPack declarations needed are below
 * (DLPack 1.x, whose exchange table torch exposes as the capsule
 * ``torch.Tensor.__dlpack_c_exchange_api__``).  Built against the stable ABI
 * (Python 3.11 and later), so one build serves every interpreter. */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* ---- DLPack 1.x, as far as this module reads it --------------------------- */
typedef struct { uint32_t major, minor; } DLPackVersion;
typedef struct { int32_t device_type, device_id; } DLDevice;
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;
typedef struct {
    DLPackExchangeAPIHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

/* ---- the fields of a launch ------------------------------------------------ */
/* ROWS and ROW_STRIDE read a contiguous (..., N) tensor as the (M, N) rows
 * a row-wise kernel takes (M the product of the leading sizes, row stride
 * N) with no view made in Python; CURRENT_STREAM is torch's current stream
 * on the device of the call's first tensor.  PER_STREAM writes nothing: it
 * says the argument is a dict from stream handles (ints) to the tensor its
 * later fields read, the entry of that current stream (a call on a stream
 * without one, or on a stream a CUDA graph is capturing, is declined), so a
 * kernel's per-stream buffers (split K's workspace) cost no Python lookup;
 * or a tensor, read as it is (a capture's own buffers). */
enum what {
    DATA = 'd', SIZE = 's', STRIDE = 't', VALUE = 'v', STREAM = 'q',
    ROWS = 'S', ROW_STRIDE = 'T', CURRENT_STREAM = 'Q', PER_STREAM = 'K'
};
enum ctype { I32 = 'i', I64 = 'l', F32 = 'f', F64 = 'd', BOOL = 'b' };

typedef struct {
    int32_t arg;    /* positional argument index */
    char what;      /* enum what */
    char ctype;     /* enum ctype (ignored for DATA and STREAM: 64-bit) */
    int32_t dim;    /* for SIZE and STRIDE */
    int64_t offset; /* byte offset in the buffer */
} Field;

/* The CuTe DSL runtime's CuteDSLRT_Function_Run, for objects its C loader loaded. */
typedef int (*run_function)(void *function, void **args, size_t num_args);

typedef struct {
    PyObject_HEAD
    void (*entry)(void **);
    /* Where set: launch with run(entry, packed, count) (the DSL runtime's
     * function handle in entry) instead of entry(packed). */
    run_function run;
    size_t count;
    Py_buffer packed_view; /* the pointer array the entry point takes */
    Py_buffer buffer_view; /* the fields' storage, pointed into by the array */
    Py_buffer result_view; /* the CUDA status the entry point writes (len 0: none) */
    void **packed;
    char *buffer;
    int32_t *result;
    const DLPackExchangeAPI *api;
    PyObject *tensor_type; /* torch.Tensor: the type the exchange table serves */
    Py_ssize_t nargs;
    Py_ssize_t nfields;
    Field *fields;
    /* Where set: the launch's CUDA context, checked before each call (a
     * launch from another current context returns NotImplemented). */
    int (*get_context)(void **);
    void *context;
    /* Where set: the driver's cuStreamIsCapturing, asked before a
     * PER_STREAM dict is read (kept buffers never enter a graph). */
    int (*stream_capturing)(void *stream, int *status);
    /* Where >= 0: every tensor must be on this CUDA device, or the call is
     * declined (NotImplemented, nothing launched). */
    int32_t device;
} Launcher;

/* One field's value, read before anything is written. */
typedef union {
    double d;
    long long i;
    void *p;
} Scalar;

#define MAX_FIELDS 256

static int fits(char ctype, long long v) {
    if (ctype == I32 && (v < INT32_MIN || v > INT32_MAX)) {
        PyErr_Format(PyExc_OverflowError, "quack launcher: %lld does not fit a 32-bit argument", v);
        return 0;
    }
    return 1;
}

/* Whether a tensor has elements: a null data pointer is only valid without any. */
static int has_elements(const DLTensor *t) {
    for (int32_t d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0) return 0;
    return 1;
}

/* The tensor's DLTensor view, checked to be a torch.Tensor (what the table serves). */
static int view(Launcher *self, PyObject *obj, Py_ssize_t index, DLTensor *out) {
    if (!PyObject_TypeCheck(obj, (PyTypeObject *)self->tensor_type)) {
        PyErr_Format(PyExc_TypeError, "quack launcher: argument %zd must be a torch.Tensor", index);
        return -1;
    }
    return self->api->dltensor_from_py_object_no_sync((void *)obj, out);
}

/* torch's current stream on the device of the call's first tensor (read
 * before: device_id >= 0). */
static int current_stream(Launcher *self, DLDevice first, void **out) {
    if (first.device_id < 0) {
        PyErr_SetString(PyExc_ValueError, "quack launcher: the current stream follows a tensor argument");
        return -1;
    }
    if (self->api->current_work_stream == NULL ||
        self->api->current_work_stream(first.device_type, first.device_id, out) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "quack launcher: torch gave no current stream");
        return -1;
    }
    return 0;
}

/* The current stream of one call, asked about once (known) by the first
 * PER_STREAM argument and reused by the others. */
typedef struct {
    int known;
    void *handle;
} CallStream;

/* The PER_STREAM argument's tensor, a new reference kept in held[arg]: the
 * argument itself where it is a tensor, else its dict's entry for the
 * current stream (0: none, or the stream is capturing a graph, or the driver
 * cannot tell: the call is declined; -1: an error).  The first dict of a
 * call asks torch and the driver about the current stream; the others reuse
 * the answer, kept in *stream. */
static int stream_entry(Launcher *self, PyObject *given, DLDevice first, int32_t arg, PyObject **held,
                        CallStream *stream) {
    if (PyObject_TypeCheck(given, (PyTypeObject *)self->tensor_type)) {
        Py_INCREF(given);
        Py_XDECREF(held[arg]);
        held[arg] = given;
        return 1;
    }
    if (!PyDict_Check(given)) {
        PyErr_Format(PyExc_TypeError, "quack launcher: argument %d must be a tensor or a dict of the streams' tensors",
                     arg);
        return -1;
    }
    if (!stream->known) {
        if (current_stream(self, first, &stream->handle) < 0) return -1;
        if (self->stream_capturing != NULL) {
            int status = 0;
            if (self->stream_capturing(stream->handle, &status) != 0 || status != 0) return 0;
        }
        stream->known = 1;
    }
    PyObject *key = PyLong_FromVoidPtr(stream->handle);
    if (key == NULL) return -1;
    PyObject *entry = PyObject_GetItem(given, key);
    Py_DECREF(key);
    if (entry == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
        PyErr_Clear();
        return 0;
    }
    Py_XDECREF(held[arg]);
    held[arg] = entry;
    return 1;
}

/* Step 1: every field's value, with every check (a tensor with elements and
 * a null data pointer, a fake or meta tensor, is refused).  Python code may
 * run here (__float__ and __index__ of scalars, __torch_dispatch__ of a
 * tensor subclass's sizes) and let another thread run.  held[arg] keeps a
 * PER_STREAM argument's tensor alive until the launch.  Returns -1 on an
 * error, 1 where a tensor is on another device than the launcher's or a
 * stream has no entry (declined). */
static int read_values(Launcher *self, PyObject *const *args, Scalar *values, PyObject **held) {
    DLTensor t;
    Py_ssize_t viewed = -1; /* the argument t describes */
    CallStream stream = {0, NULL}; /* the current stream, once a PER_STREAM dict is read */
    DLDevice first = {0, -1}; /* the device of the first tensor read */
    for (Py_ssize_t i = 0; i < self->nfields; i++) {
        const Field *f = &self->fields[i];
        PyObject *obj = held[f->arg] != NULL ? held[f->arg] : args[f->arg];
        if (f->what == PER_STREAM) {
            int found = stream_entry(self, args[f->arg], first, f->arg, held, &stream);
            if (found <= 0) return found < 0 ? -1 : 1;
        } else if (f->what == CURRENT_STREAM) {
            if (current_stream(self, first, &values[i].p) < 0) return -1;
        } else if (f->what == STREAM) {
            values[i].p = PyLong_AsVoidPtr(obj);
            if (values[i].p == NULL && PyErr_Occurred()) return -1;
        } else if (f->what == VALUE && (f->ctype == F32 || f->ctype == F64)) {
            values[i].d = PyFloat_AsDouble(obj);
            if (values[i].d == -1.0 && PyErr_Occurred()) return -1;
            /* As struct.pack("<f") decides: only a finite value that rounds to infinity overflows. */
            if (f->ctype == F32 && isinf((float)values[i].d) && !isinf(values[i].d)) {
                PyErr_SetString(PyExc_OverflowError, "quack launcher: float too large for a 32-bit argument");
                return -1;
            }
        } else if (f->what == VALUE) {
            values[i].i = PyLong_AsLongLong(obj);
            if ((values[i].i == -1 && PyErr_Occurred()) || !fits(f->ctype, values[i].i)) return -1;
        } else {
            if (viewed != f->arg) {
                if (view(self, obj, f->arg, &t) < 0) return -1;
                viewed = f->arg;
                if (self->device >= 0 && t.device.device_id != self->device) return 1;
                if (first.device_id < 0) first = t.device;
            }
            if (f->what == DATA) {
                if (t.data == NULL && has_elements(&t)) {
                    PyErr_Format(PyExc_ValueError,
                                 "quack launcher: argument %d is a tensor with elements but no memory (a null data "
                                 "pointer: a fake or meta tensor?); nothing was launched. Launch on real CUDA "
                                 "tensors, or warm kernels on fake ones inside quack.compile_only.compile_only_mode()",
                                 f->arg);
                    return -1;
                }
                values[i].p = (char *)t.data + t.byte_offset;
                continue;
            }
            if (f->what == ROWS || f->what == ROW_STRIDE) {
                if (t.ndim < 1) {
                    PyErr_Format(PyExc_ValueError, "quack launcher: argument %d has no rows", f->arg);
                    return -1;
                }
                long long rows = 1;
                for (int32_t d = 0; d + 1 < t.ndim; d++) rows *= t.shape[d];
                values[i].i = f->what == ROWS ? rows : t.shape[t.ndim - 1];
                if (!fits(f->ctype, values[i].i)) return -1;
                continue;
            }
            if (f->dim >= t.ndim) {
                PyErr_Format(PyExc_ValueError,
                             "quack launcher: argument %d has %d dimensions, the kernel reads dimension %d", f->arg,
                             t.ndim, f->dim);
                return -1;
            }
            values[i].i = f->what == SIZE ? t.shape[f->dim] : t.strides[f->dim];
            if (!fits(f->ctype, values[i].i)) return -1;
        }
    }
    return 0;
}

/* Step 2: plain stores into the shared buffer.  No Python code runs from
 * here to the launch, so the GIL stays held and no other thread writes the
 * buffer between this call's stores and its launch. */
static void write_fields(Launcher *self, const Scalar *values) {
    for (Py_ssize_t i = 0; i < self->nfields; i++) {
        const Field *f = &self->fields[i];
        char *at = self->buffer + f->offset;
        if (f->what == PER_STREAM) continue;
        if (f->what == DATA || f->what == STREAM || f->what == CURRENT_STREAM) {
            *(void **)at = values[i].p;
            continue;
        }
        switch (f->ctype) {
        case F32: *(float *)at = (float)values[i].d; break;
        case F64: *(double *)at = values[i].d; break;
        case I32: *(int32_t *)at = (int32_t)values[i].i; break;
        case I64: *(int64_t *)at = (int64_t)values[i].i; break;
        case BOOL: *(uint8_t *)at = values[i].i != 0; break;
        }
    }
}

static int takes(Launcher *self, Py_ssize_t n) {
    if (n == self->nargs) return 1;
    PyErr_Format(PyExc_TypeError, "kernel takes %zd arguments, got %zd", self->nargs, n);
    return 0;
}

/* read_values, write_fields, launch: None, NotImplemented, or NULL on an error. */
static PyObject *launch_with(Launcher *self, PyObject *const *items, Scalar *values, PyObject **held) {
    int read = read_values(self, items, values, held);
    if (read < 0) return NULL;
    if (read > 0) Py_RETURN_NOTIMPLEMENTED;
    write_fields(self, values);
    if (self->run != NULL) {
        int status = self->run((void *)self->entry, self->packed, self->count);
        if (status != 0) {
            PyErr_Format(PyExc_RuntimeError, "kernel launch failed: CuTe DSL runtime error %d", status);
            return NULL;
        }
    } else {
        self->entry(self->packed);
    }
    if (self->result != NULL && *self->result != 0) {
        PyErr_Format(PyExc_RuntimeError, "kernel launch failed with CUDA error %d", *self->result);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The launch on items[0:n]: None, NotImplemented (declined), or NULL on an error. */
static PyObject *launcher_run(Launcher *self, PyObject *const *items, Py_ssize_t n) {
    if (!takes(self, n)) return NULL;
    if (self->get_context != NULL) {
        void *current = NULL;
        if (self->get_context(&current) != 0 || current != self->context) Py_RETURN_NOTIMPLEMENTED;
    }
    Scalar values[MAX_FIELDS];
    PyObject *held[64] = {NULL};
    PyObject *outcome = launch_with(self, items, values, held);
    for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(held[i]);
    return outcome;
}

static PyObject *launcher_call(PyObject *op, PyObject *args, PyObject *kwargs) {
    if (kwargs != NULL && PyDict_Size(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "quack launcher: arguments are positional");
        return NULL;
    }
    Py_ssize_t n = PyTuple_Size(args);
    if (!takes((Launcher *)op, n)) return NULL; /* (at most 64) */
    PyObject *items[64];
    for (Py_ssize_t i = 0; i < n; i++) items[i] = PyTuple_GetItem(args, i); /* borrowed */
    return launcher_run((Launcher *)op, items, n);
}

/* bare(n): the entry point called n times from C with the buffer as the last
 * call left it; seconds in all.  What the launch costs without any packing. */
static PyObject *launcher_bare(PyObject *op, PyObject *arg) {
    Launcher *self = (Launcher *)op;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        if (self->run != NULL)
            self->run((void *)self->entry, self->packed, self->count);
        else
            self->entry(self->packed);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    return PyFloat_FromDouble((double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec));
}

static int one_of(const char *code, const char *codes) {
    return code != NULL && code[0] != 0 && code[1] == 0 && strchr(codes, code[0]) != NULL;
}

/* A field's kind, and its C type where the kind takes one. */
static int valid_field(const char *what, const char *ctype) {
    if (!one_of(what, "dstvqSTQK")) return 0;
    return what[0] == 'd' || what[0] == 'q' || what[0] == 'Q' || what[0] == 'K' || one_of(ctype, "ildfb");
}

static int field_size(char what, char ctype) {
    if (what == PER_STREAM) return 0;
    if (what == DATA || what == STREAM || what == CURRENT_STREAM) return 8;
    return ctype == I32 || ctype == F32 ? 4 : ctype == BOOL ? 1 : 8;
}

/* The fields as a table, each checked against the argument count and the buffer's size. */
static Field *field_table(PyObject *fields, Py_ssize_t nargs, Py_ssize_t buffer_len, Py_ssize_t *count) {
    PyObject *seq = PySequence_Fast(fields, "fields must be a sequence");
    if (seq == NULL) return NULL;
    *count = PySequence_Size(seq);
    if (*count > MAX_FIELDS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "quack launcher: at most %d fields", MAX_FIELDS);
        return NULL;
    }
    Field *table = PyMem_Calloc(*count ? *count : 1, sizeof(Field));
    if (table == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *count; i++) {
        const char *what, *ctype;
        int arg, dim;
        long long offset;
        PyObject *item = PySequence_GetItem(seq, i);
        int ok = item != NULL && PyArg_ParseTuple(item, "isziL", &arg, &what, &ctype, &dim, &offset);
        Py_XDECREF(item);
        if (ok && (arg < 0 || arg >= nargs || dim < 0 || !valid_field(what, ctype) || offset < 0 ||
                   offset + field_size(what[0], ctype ? ctype[0] : 0) > buffer_len)) {
            PyErr_Format(PyExc_ValueError, "quack launcher: bad field %zd", i);
            ok = 0;
        }
        if (!ok) {
            PyMem_Free(table);
            Py_DECREF(seq);
            return NULL;
        }
        table[i] = (Field){arg, what[0], ctype ? ctype[0] : 0, dim, offset};
    }
    Py_DECREF(seq);
    return table;
}

static void release_views(Launcher *self) {
    if (self->packed_view.obj) PyBuffer_Release(&self->packed_view);
    if (self->buffer_view.obj) PyBuffer_Release(&self->buffer_view);
    if (self->result_view.obj) PyBuffer_Release(&self->result_view);
}

/* Launcher(entry, packed, buffer, result, nargs, fields, api, tensor_type[, get_context, context, run, count,
 *          device, stream_capturing])
 * entry: the entry point's address; packed, buffer and result (or None):
 * writable buffers (a ctypes array, an array.array, a ctypes c_int32), held
 * for the launcher's life; fields: a sequence of (arg, what, ctype, dim,
 * offset) with what and ctype one-letter strings; api: the
 * "dlpack_exchange_api" capsule; tensor_type: torch.Tensor; get_context:
 * the address of the driver's cuCtxGetCurrent and context the one the
 * entry point's module was loaded in (0, 0: no check); run: the address of
 * CuteDSLRT_Function_Run, with entry its function handle and count the
 * pointer array's length (0: entry is a plain entry point); device: the CUDA
 * device every tensor must be on (-1: any); stream_capturing: the address of
 * the driver's cuStreamIsCapturing (0: PER_STREAM dicts are read under a
 * capture too). */
static PyObject *launcher_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    unsigned long long entry, get_context = 0, context = 0, run = 0, stream_capturing = 0;
    Py_ssize_t count = 0;
    int device = -1;
    Py_ssize_t nargs;
    PyObject *packed, *buffer, *result, *fields, *capsule, *tensor_type;
    if (kwargs != NULL && PyDict_Size(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "quack launcher: arguments are positional");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "KOOOnOOO|KKKniK", &entry, &packed, &buffer, &result, &nargs, &fields, &capsule,
                          &tensor_type, &get_context, &context, &run, &count, &device, &stream_capturing))
        return NULL;
    if (!entry) {
        PyErr_SetString(PyExc_ValueError, "quack launcher: the entry point's address is 0");
        return NULL;
    }
    if (nargs < 0 || nargs > 64) {
        PyErr_SetString(PyExc_ValueError, "quack launcher: at most 64 arguments");
        return NULL;
    }
    if (!PyType_Check(tensor_type)) {
        PyErr_SetString(PyExc_TypeError, "quack launcher: tensor_type must be a type (torch.Tensor)");
        return NULL;
    }
    const DLPackExchangeAPI *api = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
    if (api == NULL) return NULL;
    if (api->header.version.major != 1 || api->dltensor_from_py_object_no_sync == NULL) {
        PyErr_Format(PyExc_RuntimeError, "quack launcher: DLPack exchange table %u.%u without a DLTensor export",
                     api->header.version.major, api->header.version.minor);
        return NULL;
    }
    Launcher *self = (Launcher *)PyType_GenericAlloc(type, 0);
    if (self == NULL) return NULL;
    if (PyObject_GetBuffer(packed, &self->packed_view, PyBUF_WRITABLE) < 0 ||
        PyObject_GetBuffer(buffer, &self->buffer_view, PyBUF_WRITABLE) < 0 ||
        (result != Py_None && PyObject_GetBuffer(result, &self->result_view, PyBUF_WRITABLE) < 0))
        goto fail;
    if (self->packed_view.len < (Py_ssize_t)sizeof(void *) || (result != Py_None && self->result_view.len < 4)) {
        PyErr_SetString(PyExc_ValueError, "quack launcher: the pointer array or the status is too small");
        goto fail;
    }
    self->fields = field_table(fields, nargs, self->buffer_view.len, &self->nfields);
    if (self->fields == NULL) goto fail;
    self->entry = (void (*)(void **))(uintptr_t)entry;
    self->packed = self->packed_view.buf;
    self->buffer = self->buffer_view.buf;
    self->result = result == Py_None ? NULL : self->result_view.buf;
    self->api = api;
    if (run != 0 && (count < 1 || (size_t)count * sizeof(void *) > (size_t)self->packed_view.len)) {
        PyErr_SetString(PyExc_ValueError, "quack launcher: the runtime's argument count does not fit the pointer array");
        goto fail;
    }
    self->device = device;
    self->run = (run_function)(uintptr_t)run;
    self->count = (size_t)count;
    self->get_context = (int (*)(void **))(uintptr_t)get_context;
    self->context = (void *)(uintptr_t)context;
    self->stream_capturing = (int (*)(void *, int *))(uintptr_t)stream_capturing;
    Py_INCREF(tensor_type);
    self->tensor_type = tensor_type;
    self->nargs = nargs;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static void launcher_dealloc(PyObject *op) {
    Launcher *self = (Launcher *)op;
    PyTypeObject *type = Py_TYPE(op);
    Py_XDECREF(self->tensor_type);
    release_views(self);
    PyMem_Free(self->fields);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(op);
    Py_DECREF(type);
}

static PyMethodDef launcher_methods[] = {
    {"bare", launcher_bare, METH_O, "bare(n): seconds for n calls of the entry point from C, no packing"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot launcher_slots[] = {
    {Py_tp_new, launcher_new},
    {Py_tp_dealloc, launcher_dealloc},
    {Py_tp_call, launcher_call},
    {Py_tp_methods, launcher_methods},
    {Py_tp_doc, "Launcher(entry, packed, buffer, result, nargs, fields, api, tensor_type); launcher(*args)"},
    {0, NULL},
};

static PyType_Spec launcher_spec = {
    "quack.launch._fastlaunch.Launcher", sizeof(Launcher), 0, Py_TPFLAGS_DEFAULT, launcher_slots,
};

/* ---- a kernel handle's call: its checked launcher first, in C ---------------
 *
 * Front is KernelHandle's base (quack/launch/handle.py): calling a handle
 * calls its ``checked`` launcher (the C Launcher of its module on its first
 * launch's device, set once that launch is done) and, where there is none
 * or it declines (NotImplemented: another device), the handle's
 * ``_call_guarded``.  No Python frame on the common call. */

typedef struct {
    PyObject_HEAD
    PyObject *checked; /* a Launcher or NULL */
} Front;

static PyObject *guarded_name = NULL;

static PyObject *front_call(PyObject *op, PyObject *args, PyObject *kwargs) {
    Front *self = (Front *)op;
    if (self->checked != NULL) {
        PyObject *checked = self->checked;
        Py_INCREF(checked); /* a concurrent reset may drop the slot's reference */
        PyObject *result = PyObject_Call(checked, args, kwargs);
        Py_DECREF(checked);
        if (result != Py_NotImplemented) return result;
        Py_DECREF(result);
    }
    PyObject *guarded = PyObject_GetAttr(op, guarded_name);
    if (guarded == NULL) return NULL;
    PyObject *result = PyObject_Call(guarded, args, kwargs);
    Py_DECREF(guarded);
    return result;
}

static PyObject *front_get_checked(PyObject *op, void *closure) {
    (void)closure;
    PyObject *checked = ((Front *)op)->checked;
    if (checked == NULL) Py_RETURN_NONE;
    Py_INCREF(checked);
    return checked;
}

static int front_set_checked(PyObject *op, PyObject *value, void *closure) {
    (void)closure;
    Front *self = (Front *)op;
    PyObject *old = self->checked;
    if (value == Py_None) value = NULL;
    Py_XINCREF(value);
    self->checked = value;
    Py_XDECREF(old);
    return 0;
}

static void front_dealloc(PyObject *op) {
    PyTypeObject *type = Py_TYPE(op);
    Front *self = (Front *)op;
    Py_CLEAR(self->checked);
    freefunc free_object = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_object(op);
    Py_DECREF(type);
}

static PyGetSetDef front_getset[] = {
    {"checked", front_get_checked, front_set_checked,
     "the launcher tried first (None: every call takes _call_guarded)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot front_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, front_dealloc},
    {Py_tp_call, front_call},
    {Py_tp_getset, front_getset},
    {Py_tp_doc, "A kernel handle's base: calls its checked launcher, else its _call_guarded."},
    {0, NULL},
};

static PyType_Spec front_spec = {
    "quack.launch._fastlaunch.Front", sizeof(Front), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, front_slots,
};

/* ---- a call's description: the eager fast path's key ----------------------
 *
 * describe(grad_enabled, *args) -> bytes, or None where the call is not one
 * the fast path takes.  The bytes hold everything an op's checks and plan
 * read from its arguments: per tensor its dtype, device, shape, strides, the
 * alignment of its address (mod 16) and, under grad mode, requires_grad; per
 * None, bool or int its value.  Two calls with equal descriptions pass the
 * same checks and take the same plan, so the first call's launch closure
 * serves the second (quack/calls/fastpath.py).  Any other argument (a float, a
 * tensor subclass other than the configured types) gives None. */

static const DLPackExchangeAPI *described_api = NULL; /* set by configure() */
static PyObject *described_capsule = NULL;          /* holds the table alive */
static PyObject *described_types = NULL;            /* a tuple of exact types */
static PyObject *requires_grad_name = NULL;

#define DESCRIPTION_MAX 2048

static int exact_type(PyObject *obj) {
    Py_ssize_t n = PyTuple_Size(described_types);
    for (Py_ssize_t i = 0; i < n; i++)
        if ((PyObject *)Py_TYPE(obj) == PyTuple_GetItem(described_types, i)) return 1;
    return 0;
}

static int put(char *out, Py_ssize_t *used, const void *bytes, Py_ssize_t size) {
    if (*used + size > DESCRIPTION_MAX) return 0;
    memcpy(out + *used, bytes, size);
    *used += size;
    return 1;
}

/* One tensor's part of the description; 0 where it cannot be described. */
static int describe_tensor(PyObject *obj, int grad_enabled, char *out, Py_ssize_t *used) {
    DLTensor t;
    if (described_api->dltensor_from_py_object_no_sync((void *)obj, &t) != 0) {
        PyErr_Clear();
        return 0;
    }
    uint8_t alignment = (uint8_t)(((uintptr_t)t.data + t.byte_offset) & 15);
    uint8_t requires_grad = 0;
    if (grad_enabled) {
        PyObject *flag = PyObject_GetAttr(obj, requires_grad_name);
        if (flag == NULL) {
            PyErr_Clear();
            return 0;
        }
        requires_grad = flag == Py_True;
        Py_DECREF(flag);
    }
    if (!put(out, used, "t", 1) || !put(out, used, &t.dtype, sizeof t.dtype) ||
        !put(out, used, &t.device, sizeof t.device) || !put(out, used, &t.ndim, sizeof t.ndim) ||
        !put(out, used, &alignment, 1) || !put(out, used, &requires_grad, 1) ||
        !put(out, used, t.shape, (Py_ssize_t)sizeof(int64_t) * t.ndim))
        return 0;
    if (t.strides != NULL) return put(out, used, t.strides, (Py_ssize_t)sizeof(int64_t) * t.ndim);
    int64_t stride = 1, strides[64];
    if (t.ndim > 64) return 0;
    for (int32_t d = t.ndim - 1; d >= 0; d--) {
        strides[d] = stride;
        stride *= t.shape[d];
    }
    return put(out, used, strides, (Py_ssize_t)sizeof(int64_t) * t.ndim);
}

/* The description of args[0:n] into out; 1 where every argument could be
 * described, 0 where the fast path does not take the call. */
static int describe_into(int grad_enabled, PyObject *const *args, Py_ssize_t n, char *out, Py_ssize_t *used) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = args[i];
        int ok;
        if (obj == Py_None) {
            ok = put(out, used, "n", 1);
        } else if (obj == Py_True || obj == Py_False) {
            ok = put(out, used, obj == Py_True ? "T" : "F", 1);
        } else if (PyLong_CheckExact(obj)) {
            long long value = PyLong_AsLongLong(obj);
            if (value == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            ok = put(out, used, "i", 1) && put(out, used, &value, sizeof value);
        } else if (exact_type(obj)) {
            ok = describe_tensor(obj, grad_enabled, out, used);
        } else {
            ok = 0;
        }
        if (!ok) return 0;
    }
    return 1;
}

static int configured(void) {
    if (described_api != NULL) return 1;
    PyErr_SetString(PyExc_RuntimeError, "quack launcher: describe() before configure()");
    return 0;
}

static PyObject *describe(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (!configured()) return NULL;
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "describe(grad_enabled, *args)");
        return NULL;
    }
    char out[DESCRIPTION_MAX];
    Py_ssize_t used = 0;
    if (!describe_into(args[0] == Py_True, args + 1, nargs - 1, out, &used)) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(out, used);
}

/* dispatch(closures, grad_enabled, described, *args): the eager fast path's
 * whole per-call work before the launch closure in one C call.  Describes
 * args[:described] as describe() does, looks the description up in the dict
 * ``closures`` and returns closure(*args); NotImplemented where the call
 * cannot be described or no closure is kept for it. */
/* ---- launch closures in C ---------------------------------------------------
 *
 * LikeLaunch(launcher, allocate, outputs, template): the launch closure of a
 * row-wise op whose outputs are all like its first argument: it allocates
 * ``outputs`` of them (``allocate(first)``, torch.empty_like) and calls ``launcher`` with, per template
 * entry, the call's argument i (i >= 0), None (-1) or output j (-2 - j);
 * returns the output (or the tuple of them), or NotImplemented where the
 * launcher declined.  The same as a Python closure, with no Python frame. */

typedef struct {
    PyObject_HEAD
    PyObject *launcher, *allocate;
    Py_ssize_t outputs;
    Py_ssize_t count; /* template entries */
    Py_ssize_t template[16];
} LikeLaunch;

static PyObject *like_launch_type = NULL;
static PyObject *launcher_type = NULL; /* set by module_exec */

static PyObject *like_launch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *launcher, *allocate, *template;
    Py_ssize_t outputs;
    if (kwargs != NULL && PyDict_Size(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "LikeLaunch(launcher, allocate, outputs, template): positional arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOnO", &launcher, &allocate, &outputs, &template)) return NULL;
    Py_ssize_t count = PyTuple_Check(template) ? PyTuple_Size(template) : -1;
    if (count < 0 || count > 16 || outputs < 1 || outputs > 4 || !PyCallable_Check(launcher) ||
        !PyCallable_Check(allocate)) {
        PyErr_SetString(PyExc_ValueError,
                        "LikeLaunch: a callable launcher and allocator, 1 to 4 outputs, a tuple of at most 16 entries");
        return NULL;
    }
    LikeLaunch *self = (LikeLaunch *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
    if (self == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t entry = PyLong_AsSsize_t(PyTuple_GetItem(template, i));
        if ((entry == -1 && PyErr_Occurred()) || entry < -2 - (outputs - 1)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "LikeLaunch: a template entry names no output");
            Py_DECREF(self);
            return NULL;
        }
        self->template[i] = entry;
    }
    Py_INCREF(launcher);
    Py_INCREF(allocate);
    self->launcher = launcher;
    self->allocate = allocate;
    self->outputs = outputs;
    self->count = count;
    return (PyObject *)self;
}

static void like_launch_dealloc(PyObject *op) {
    PyTypeObject *type = Py_TYPE(op);
    Py_CLEAR(((LikeLaunch *)op)->launcher);
    Py_CLEAR(((LikeLaunch *)op)->allocate);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(op);
    Py_DECREF(type);
}

/* The closure on a call's arguments (n of them, the first a tensor). */
static PyObject *like_launch_run(LikeLaunch *self, PyObject *const *args, Py_ssize_t n) {
    PyObject *outs[4] = {NULL, NULL, NULL, NULL};
    PyObject *result = NULL, *call_args = NULL;
    if (n < 1) {
        PyErr_SetString(PyExc_TypeError, "LikeLaunch: the call has no argument to allocate like");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < self->outputs; j++) {
        if ((outs[j] = PyObject_CallFunctionObjArgs(self->allocate, args[0], NULL)) == NULL) goto done;
    }
    PyObject *items[16]; /* borrowed: the call's arguments and outs[] outlive the launch */
    for (Py_ssize_t i = 0; i < self->count; i++) {
        Py_ssize_t entry = self->template[i];
        items[i] = entry >= 0 ? (entry < n ? args[entry] : NULL) : entry == -1 ? Py_None : outs[-2 - entry];
        if (items[i] == NULL) {
            PyErr_SetString(PyExc_IndexError, "LikeLaunch: the template names an argument the call lacks");
            goto done;
        }
    }
    PyObject *launched;
    if (Py_TYPE(self->launcher) == (PyTypeObject *)launcher_type) {
        launched = launcher_run((Launcher *)self->launcher, items, self->count); /* no tuple, no tp_call */
    } else {
        if ((call_args = PyTuple_New(self->count)) == NULL) goto done;
        for (Py_ssize_t i = 0; i < self->count; i++) {
            Py_INCREF(items[i]);
            PyTuple_SetItem(call_args, i, items[i]);
        }
        launched = PyObject_Call(self->launcher, call_args, NULL);
    }
    if (launched == NULL) goto done;
    if (launched != Py_None) { /* declined: NotImplemented */
        result = launched;
        goto done;
    }
    Py_DECREF(launched);
    if (self->outputs == 1) {
        result = outs[0];
        outs[0] = NULL;
    } else {
        result = PyTuple_New(self->outputs);
        for (Py_ssize_t j = 0; result != NULL && j < self->outputs; j++) {
            PyTuple_SetItem(result, j, outs[j]);
            outs[j] = NULL;
        }
    }
done:
    Py_XDECREF(call_args);
    for (Py_ssize_t j = 0; j < 4; j++) Py_XDECREF(outs[j]);
    return result;
}

static PyObject *like_launch_call(PyObject *op, PyObject *args, PyObject *kwargs) {
    if (kwargs != NULL && PyDict_Size(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "LikeLaunch: positional arguments");
        return NULL;
    }
    Py_ssize_t n = PyTuple_Size(args);
    PyObject *items[16];
    if (n > 16) {
        PyErr_SetString(PyExc_TypeError, "LikeLaunch: at most 16 arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) items[i] = PyTuple_GetItem(args, i);
    return like_launch_run((LikeLaunch *)op, items, n);
}

static PyType_Slot like_launch_slots[] = {
    {Py_tp_new, like_launch_new},
    {Py_tp_dealloc, like_launch_dealloc},
    {Py_tp_call, like_launch_call},
    {Py_tp_doc, "LikeLaunch(launcher, allocate, outputs, template): a row-wise op's launch closure in C"},
    {0, NULL},
};

static PyType_Spec like_launch_spec = {
    "quack.launch._fastlaunch.LikeLaunch", sizeof(LikeLaunch), 0, Py_TPFLAGS_DEFAULT, like_launch_slots,
};

/* ---- the dispatch: describe, look up, run ------------------------------------ */

/* The kept closure's result for args[0:n] (the first ``described`` of them
 * describe the call), or NotImplemented where there is none. */
static PyObject *dispatch_in(PyObject *closures, int grad_enabled, Py_ssize_t described, PyObject *const *args,
                             Py_ssize_t n) {
    char out[DESCRIPTION_MAX];
    Py_ssize_t used = 0;
    if (!describe_into(grad_enabled, args, described, out, &used)) Py_RETURN_NOTIMPLEMENTED;
    PyObject *key = PyBytes_FromStringAndSize(out, used);
    if (key == NULL) return NULL;
    PyObject *run = PyDict_GetItemWithError(closures, key); /* borrowed */
    Py_DECREF(key);
    if (run == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    /* Held from here: an allocation below may run the garbage collector, whose
     * finalizers may let another thread drop the closure from the dict. */
    Py_INCREF(run);
    PyObject *result;
    if (Py_TYPE(run) == (PyTypeObject *)like_launch_type) {
        result = like_launch_run((LikeLaunch *)run, args, n);
    } else {
        PyObject *call_args = PyTuple_New(n);
        if (call_args == NULL) {
            Py_DECREF(run);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_INCREF(args[i]);
            PyTuple_SetItem(call_args, i, args[i]);
        }
        result = PyObject_Call(run, call_args, NULL);
        Py_DECREF(call_args);
    }
    Py_DECREF(run);
    return result;
}

static PyObject *dispatch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (!configured()) return NULL;
    if (nargs < 3 || !PyDict_Check(args[0]) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "dispatch(closures: dict, grad_enabled, described: int, *args)");
        return NULL;
    }
    Py_ssize_t described = PyLong_AsSsize_t(args[2]);
    if (described < 0 || described > nargs - 3) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dispatch: described counts more arguments than given");
        return NULL;
    }
    return dispatch_in(args[0], args[1] == Py_True, described, args + 3, nargs - 3);
}

/* Dispatcher(closures, compile_only_depth, grad_enabled): one op's
 * ``dispatch`` with the flags read in C: ``dispatcher(described, *args)``
 * is NotImplemented while ``compile_only_depth()`` is non-zero, else
 * dispatch(closures, grad_enabled(), described, *args). */
typedef struct {
    PyObject_HEAD
    PyObject *closures, *depth, *grad_enabled;
} Dispatcher;

static PyObject *dispatcher_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *closures, *depth, *grad_enabled;
    if (kwargs != NULL && PyDict_Size(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "Dispatcher(closures, compile_only_depth, grad_enabled): positional arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!OO", &PyDict_Type, &closures, &depth, &grad_enabled)) return NULL;
    if (!configured()) return NULL;
    Dispatcher *self = (Dispatcher *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(closures);
    Py_INCREF(depth);
    Py_INCREF(grad_enabled);
    self->closures = closures;
    self->depth = depth;
    self->grad_enabled = grad_enabled;
    return (PyObject *)self;
}

static void dispatcher_dealloc(PyObject *op) {
    PyTypeObject *type = Py_TYPE(op);
    Dispatcher *self = (Dispatcher *)op;
    Py_CLEAR(self->closures);
    Py_CLEAR(self->depth);
    Py_CLEAR(self->grad_enabled);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(op);
    Py_DECREF(type);
}

/* A flag from a callable: 1, 0, or -1 with an exception. */
static int flag(PyObject *callable) {
    PyObject *value = PyObject_CallNoArgs(callable);
    if (value == NULL) return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

static PyObject *dispatcher_call(PyObject *op, PyObject *args, PyObject *kwargs) {
    Dispatcher *self = (Dispatcher *)op;
    Py_ssize_t n = PyTuple_Size(args);
    if ((kwargs != NULL && PyDict_Size(kwargs) > 0) || n < 1 || n > 17 || !PyLong_Check(PyTuple_GetItem(args, 0))) {
        PyErr_SetString(PyExc_TypeError, "dispatcher(described: int, *args), at most 16 positional arguments");
        return NULL;
    }
    Py_ssize_t described = PyLong_AsSsize_t(PyTuple_GetItem(args, 0));
    if (described < 0 || described > n - 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dispatcher: described counts more arguments than given");
        return NULL;
    }
    int compile_only = flag(self->depth);
    if (compile_only < 0) return NULL;
    if (compile_only) Py_RETURN_NOTIMPLEMENTED;
    int grad = flag(self->grad_enabled);
    if (grad < 0) return NULL;
    PyObject *items[16];
    for (Py_ssize_t i = 1; i < n; i++) items[i - 1] = PyTuple_GetItem(args, i);
    return dispatch_in(self->closures, grad, described, items, n - 1);
}

static PyType_Slot dispatcher_slots[] = {
    {Py_tp_new, dispatcher_new},
    {Py_tp_dealloc, dispatcher_dealloc},
    {Py_tp_call, dispatcher_call},
    {Py_tp_doc, "Dispatcher(closures, compile_only_depth, grad_enabled); dispatcher(described, *args)"},
    {0, NULL},
};

static PyType_Spec dispatcher_spec = {
    "quack.launch._fastlaunch.Dispatcher", sizeof(Dispatcher), 0, Py_TPFLAGS_DEFAULT, dispatcher_slots,
};

/* configure(api, types): the DLPack exchange capsule and the tuple of exact
 * tensor types describe() takes (torch.Tensor, torch.nn.Parameter). */
static PyObject *configure(PyObject *module, PyObject *args) {
    PyObject *capsule, *types;
    if (!PyArg_ParseTuple(args, "OO", &capsule, &types)) return NULL;
    const DLPackExchangeAPI *api = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
    if (api == NULL) return NULL;
    if (api->header.version.major != 1 || api->dltensor_from_py_object_no_sync == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "quack launcher: a DLPack exchange table without a DLTensor export");
        return NULL;
    }
    if (!PyTuple_Check(types)) {
        PyErr_SetString(PyExc_TypeError, "quack launcher: types must be a tuple of types");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_Size(types); i++) {
        if (!PyType_Check(PyTuple_GetItem(types, i))) {
            PyErr_SetString(PyExc_TypeError, "quack launcher: types must be a tuple of types");
            return NULL;
        }
    }
    if (requires_grad_name == NULL) {
        requires_grad_name = PyUnicode_InternFromString("requires_grad");
        if (requires_grad_name == NULL) return NULL;
    }
    PyObject *old_capsule = described_capsule, *old_types = described_types;
    Py_INCREF(capsule);
    Py_INCREF(types);
    described_capsule = capsule;
    described_types = types;
    Py_XDECREF(old_capsule);
    Py_XDECREF(old_types);
    described_api = api;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"describe", (PyCFunction)(void (*)(void))describe, METH_FASTCALL,
     "describe(grad_enabled, *args) -> bytes or None: the fast path's key of a call"},
    {"dispatch", (PyCFunction)(void (*)(void))dispatch, METH_FASTCALL,
     "dispatch(closures, grad_enabled, described, *args): the kept closure's result, or NotImplemented"},
    {"configure", configure, METH_VARARGS, "configure(api, types): what describe() reads tensors with"},
    {NULL, NULL, 0, NULL},
};

static int add_type(PyObject *module, const char *name, PyType_Spec *spec) {
    PyObject *type = PyType_FromSpec(spec);
    if (type == NULL) return -1;
    if (PyModule_AddObject(module, name, type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

static int module_exec(PyObject *module) {
    if (guarded_name == NULL && (guarded_name = PyUnicode_InternFromString("_call_guarded")) == NULL) return -1;
    if (add_type(module, "Launcher", &launcher_spec) < 0 || add_type(module, "Front", &front_spec) < 0 ||
        add_type(module, "Dispatcher", &dispatcher_spec) < 0 || add_type(module, "LikeLaunch", &like_launch_spec) < 0)
        return -1;
    like_launch_type = PyObject_GetAttrString(module, "LikeLaunch");
    launcher_type = PyObject_GetAttrString(module, "Launcher");
    return like_launch_type == NULL || launcher_type == NULL ? -1 : 0;
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, module_exec}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_fastlaunch", "The kernel launcher's per-call packing, in C.", 0, module_methods,
    module_slots,
};

PyMODINIT_FUNC PyInit__fastlaunch(void) { return PyModuleDef_Init(&module_def); }
