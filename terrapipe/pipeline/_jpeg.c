/* Region-of-interest JPEG decoding on libjpeg-turbo, for the loader's threads.
 *
 * Pillow decodes a whole image (at a DCT scale) while holding the GIL for its header parse.
 * Here a loader thread, without the GIL (ctypes drops it around every call), parses the
 * header, then decodes only the rows and iMCU columns that the crop's resampling filter reads:
 * rows below the region are never entropy-decoded, rows above and columns outside it are
 * entropy-decoded but not inverse-transformed, upsampled or colour-converted
 * (jpeg_skip_scanlines, jpeg_crop_scanline). Pixels inside the region are those of a full
 * decode by the same library; the caller keeps a margin so that the pixels at an interior edge
 * of the region, where chroma upsampling lacks its neighbour, are never read.
 *
 * Anything out of the ordinary (not a JPEG, CMYK/YCCK, no end-of-image marker, any libjpeg
 * warning such as a premature end of data, any error) returns a non-zero code and the caller
 * decodes that sample with Pillow, so errors and their messages are Pillow's.
 *
 * A handle belongs to one thread at a time; its state is reused image after image.
 */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#define TP_OK 0
#define TP_NOT_JPEG 1
#define TP_UNSUPPORTED 2
#define TP_FAILED 3

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} tp_error;

typedef struct {
    struct jpeg_decompress_struct cinfo;
    tp_error err;
    int have_header;
} tp_jpeg;

static void tp_error_exit(j_common_ptr cinfo) {
    tp_error *err = (tp_error *)cinfo->err;
    err->pub.format_message(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void tp_emit_message(j_common_ptr cinfo, int level) {
    /* A warning (level -1) means corrupt or truncated data: stop, so Pillow gets the sample. */
    if (level < 0) tp_error_exit(cinfo);
}

tp_jpeg *tp_jpeg_new(void) {
    tp_jpeg *volatile h = (tp_jpeg *)calloc(1, sizeof(tp_jpeg));
    if (!h) return NULL;
    h->cinfo.err = jpeg_std_error(&h->err.pub);
    h->err.pub.error_exit = tp_error_exit;
    h->err.pub.emit_message = tp_emit_message;
    if (setjmp(h->err.jump)) {
        free(h);
        return NULL;
    }
    jpeg_create_decompress(&h->cinfo);
    return h;
}

void tp_jpeg_free(tp_jpeg *h) {
    if (!h) return;
    jpeg_destroy_decompress(&h->cinfo);
    free(h);
}

const char *tp_jpeg_message(tp_jpeg *h) { return h->err.message; }

/* Whether an end-of-image marker (FF D9) follows the first scan's start, p[0:n]. A region
 * decode stops below the crop and never reaches the end of the data, so without this a
 * truncated file would decode or fail depending on where the crop fell, epoch by epoch; with
 * it, the file goes to Pillow, which reads to the end and names the truncation, whatever the
 * crop. Inside entropy-coded data FF is followed only by 00 or a restart marker, so FF D9 there
 * is the end; searched from the end, where it is (after any trailing bytes) in a whole file. */
static int tp_has_eoi(const unsigned char *p, size_t n) {
    size_t i;
    for (i = n; i >= 2; i--)
        if (p[i - 1] == 0xD9 && p[i - 2] == 0xFF) return 1;
    return 0;
}

/* Parse the header of data[0:size]; on TP_OK, *width x *height is the full image size. data
 * must stay alive and unchanged until tp_jpeg_decode returns. */
int tp_jpeg_header(tp_jpeg *h, const unsigned char *data, unsigned long size, int *width,
                   int *height) {
    if (h->have_header) jpeg_abort_decompress(&h->cinfo); /* a header never decoded */
    h->have_header = 0;
    h->err.message[0] = 0;
    if (size < 3 || data[0] != 0xFF || data[1] != 0xD8 || data[2] != 0xFF) return TP_NOT_JPEG;
    if (setjmp(h->err.jump)) {
        jpeg_abort_decompress(&h->cinfo);
        return TP_FAILED;
    }
    jpeg_mem_src(&h->cinfo, data, size);
    jpeg_read_header(&h->cinfo, TRUE);
    if (!tp_has_eoi(h->cinfo.src->next_input_byte, h->cinfo.src->bytes_in_buffer)) {
        snprintf(h->err.message, sizeof h->err.message, "no end-of-image marker: truncated");
        jpeg_abort_decompress(&h->cinfo);
        return TP_FAILED;
    }
    if (h->cinfo.jpeg_color_space != JCS_YCbCr && h->cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        h->cinfo.jpeg_color_space != JCS_RGB) {
        jpeg_abort_decompress(&h->cinfo);
        return TP_UNSUPPORTED;
    }
    *width = (int)h->cinfo.image_width;
    *height = (int)h->cinfo.image_height;
    h->have_header = 1;
    return TP_OK;
}

/* Decode rows [y0, y1) and at least columns [x0, x1) of the image scaled by 1/denom (denom in
 * 1, 2, 4, 8; the scaled size is ceil(size / denom), as Pillow's draft gives) into out as
 * RGBX rows (the 4th byte is padding) of *out_w pixels, *out_w * 4 bytes apart. Columns start at *out_x0 <= x0 (libjpeg widens
 * the region to whole iMCUs). out holds out_size bytes; a region that does not fit fails. */
int tp_jpeg_decode(tp_jpeg *h, int denom, int x0, int y0, int x1, int y1, unsigned char *out,
                   unsigned long out_size, int *out_x0, int *out_w) {
    JDIMENSION xoff, w;
    JSAMPROW row;
    unsigned long need;
    int y;
    if (!h->have_header) return TP_FAILED;
    h->have_header = 0;
    if (setjmp(h->err.jump)) {
        jpeg_abort_decompress(&h->cinfo);
        return TP_FAILED;
    }
    /* RGBX: the resampling kernel's 4-byte pixel path is a quarter faster than its 3-byte one. */
    h->cinfo.out_color_space = JCS_EXT_RGBX;
    h->cinfo.scale_num = 1;
    h->cinfo.scale_denom = (unsigned int)denom;
    jpeg_start_decompress(&h->cinfo);
    if (x0 < 0 || y0 < 0 || x1 > (int)h->cinfo.output_width || y1 > (int)h->cinfo.output_height ||
        x0 >= x1 || y0 >= y1 || h->cinfo.output_components != 4) {
        snprintf(h->err.message, sizeof h->err.message, "region %d,%d,%d,%d outside %ux%u", x0, y0,
                 x1, y1, h->cinfo.output_width, h->cinfo.output_height);
        jpeg_abort_decompress(&h->cinfo);
        return TP_FAILED;
    }
    xoff = (JDIMENSION)x0;
    w = (JDIMENSION)(x1 - x0);
    if (xoff > 0 || w < h->cinfo.output_width) jpeg_crop_scanline(&h->cinfo, &xoff, &w);
    need = (unsigned long)w * 4u * (unsigned long)(y1 - y0);
    if (need > out_size) {
        snprintf(h->err.message, sizeof h->err.message, "region needs %lu bytes, buffer has %lu",
                 need, out_size);
        jpeg_abort_decompress(&h->cinfo);
        return TP_FAILED;
    }
    if (y0 > 0) jpeg_skip_scanlines(&h->cinfo, (JDIMENSION)y0);
    for (y = 0; y < y1 - y0; y++) {
        row = out + (size_t)y * w * 4u;
        if (jpeg_read_scanlines(&h->cinfo, &row, 1) != 1) {
            snprintf(h->err.message, sizeof h->err.message, "no scanline %d", y0 + y);
            jpeg_abort_decompress(&h->cinfo);
            return TP_FAILED;
        }
    }
    /* Rows below the region are never decoded: abort, not finish (which would demand them). */
    jpeg_abort_decompress(&h->cinfo);
    *out_x0 = (int)xoff;
    *out_w = (int)w;
    return TP_OK;
}
